"""LoRABatch: which adapter slot each token of a step runs with; set and reset by the model
runner around the forward pass, read by every LoRA linear (as attention reads its metadata).
Built once per step on the host from the sequences' slots, so no layer reads the device to
group tokens. Runs of at least MIN_SEGMENT_ROWS rows on one slot (a prefill chunk) are kept as
segments, each a plain matmul pair; the other adapter tokens are sorted by slot:

    sequences [A: 2 tokens on slot 1, B: 1 token on the base, C: 3 tokens on slot 0]
    token_slots [1, 1, -1, 0, 0, 0]
    (MIN_SEGMENT_ROWS 3) segments [(0, 3, 3)]   (slot, first row, rows): C
    order [0, 1]                 the other adapter tokens' rows, sorted by slot (stable)
    offsets [0, 2] (2 slots)     end of each slot's rows in ``order``: slot 0 none, slot 1 rows 0-1
    runs [(1, 0, 2)]             (slot, first, count) in ``order`` of each slot present
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

# A run this long on one adapter is cheaper as its own matmuls written into the output's rows
# than gathered and scattered back (crossover 16-32 rows at SmolLM2's shapes, benchmarks/lora.py).
MIN_SEGMENT_ROWS = 32


@dataclass
class LoRABatch:
    token_slots: torch.Tensor  # [T] int64, -1: the base model (no adapter)
    num_slots: int  # --max-loras
    segments: list[tuple[int, int, int]]  # (slot, first row, rows) of each run of >= MIN_SEGMENT_ROWS rows
    # [N] int64 rows of the N other adapter tokens, sorted by slot; None when that is 0..N-1
    # (already in slot order from row 0: a decode batch on one adapter, or sorted by the caller)
    order: torch.Tensor | None
    offsets: torch.Tensor  # [num_slots] int32, cumulative: slot s owns sorted rows [offsets[s-1], offsets[s])
    runs: list[tuple[int, int, int]]  # (slot, first sorted row, count) of each slot present, ascending
    _masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, token_slots: torch.Tensor | np.ndarray, num_slots: int, device: torch.device | None = None,
              min_segment_rows: int = MIN_SEGMENT_ROWS) -> "LoRABatch":
        """From the step's token slots ([T], -1 for the base model), grouped on the host."""
        if isinstance(token_slots, torch.Tensor):
            device = device if device is not None else token_slots.device
            token_slots = token_slots.cpu().numpy()
        slots = np.asarray(token_slots, dtype=np.int64)
        starts = np.flatnonzero(np.diff(slots, prepend=-2))  # first row of each run of one slot
        lengths = np.diff(starts, append=len(slots))
        segments = [(int(slots[first]), int(first), int(rows)) for first, rows in zip(starts, lengths)
                    if slots[first] >= 0 and rows >= min_segment_rows]
        rest = slots.copy()
        for _, first, rows in segments:
            rest[first:first + rows] = -1
        count = int((rest >= 0).sum())
        order = np.argsort(np.where(rest < 0, num_slots, rest), kind="stable")[:count]
        counts = np.bincount(rest[rest >= 0], minlength=num_slots)
        ends = np.cumsum(counts)
        runs = [(int(slot), int(ends[slot] - counts[slot]), int(counts[slot])) for slot in np.flatnonzero(counts)]
        in_place = bool((order == np.arange(count)).all())

        def put(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device if device is not None else "cpu")

        return cls(put(slots), num_slots, segments, None if in_place else put(order), put(ends.astype(np.int32)), runs)

    @property
    def num_sorted(self) -> int:
        """Adapter tokens outside the segments (the rows ``order`` lists)."""
        return self.runs[-1][1] + self.runs[-1][2] if self.runs else 0

    @functools.cached_property
    def groups(self) -> list[tuple[int, torch.Tensor]]:
        """(slot, [n] token rows on it) for each slot present outside the segments: ``order`` cut by slot."""
        rows = self.order if self.order is not None else torch.arange(self.num_sorted, device=self.token_slots.device)
        return [(slot, rows[first:first + count]) for slot, first, count in self.runs]

    def column_mask(self, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, num_slots * rank]: 1 where column j belongs to the token's slot (j // rank), else 0;
        one per (rank, dtype) per step. slots [1, -1], 2 slots of rank 2 -> [[0, 0, 1, 1], [0, 0, 0, 0]]."""
        key = (rank, dtype)
        if key not in self._masks:
            column_slot = torch.arange(self.num_slots * rank, device=self.token_slots.device) // rank
            self._masks[key] = (self.token_slots[:, None] == column_slot[None, :]).to(dtype)
        return self._masks[key]


_current: LoRABatch | None = None


def current_lora_batch() -> LoRABatch | None:
    """This step's batch; None outside a step or when no token runs an adapter."""
    return _current


@contextlib.contextmanager
def lora_batch(batch: LoRABatch | None) -> Iterator[None]:
    global _current
    previous, _current = _current, batch
    try:
        yield
    finally:
        _current = previous
