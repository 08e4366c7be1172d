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

and also laid out slot by slot, each slot padded to the largest slot's count, for batched
matmuls over the slots (PaddedRows):

    token_slots [1, -1, 0, 1, 1, 3, 0] (4 slots, no segments)
    padded: slots 0..3, 3 rows each; rows [2, 6, 0,  0, 3, 4,  0, 0, 0,  5, 0, 0]
            pads [[F, F, T], [F, F, F], [T, T, T], [F, T, T]]   (a pad reads row 0; its product is zeroed)
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
# Padding the slots to their largest count is kept while it at most doubles the rows: beyond that
# the step runs torch._grouped_mm over the sorted rows instead (1 token on slot 0 beside 31 on
# slot 3, padded to 4 x 31 rows, measured 2.9x slower than grouped_mm; 2 + 1 + 6 padded to 4 x 6,
# 1.2x slower; 4 x 8 of 32 without pads 1.2-1.5x faster than grouped_mm).
MAX_PADDING_FACTOR = 2


@dataclass(frozen=True)
class PaddedRows:
    """The sorted adapter tokens laid out as [slots, rows_per_slot] for slots first_slot..end_slot - 1
    (the first to the last slot present; a slot in between with no token is all pads)."""
    first_slot: int
    end_slot: int
    rows_per_slot: int  # the largest count of one slot, M
    rows: torch.Tensor | None  # [P * M] int64 rows of x (pads: row 0); None when that is 0..N-1 (no pad, sorted)
    pads: torch.Tensor | None  # [P, M, 1] bool, True on a pad (its product must be zeroed); None: no pad

    @classmethod
    def build(cls, order: np.ndarray, counts: np.ndarray, put) -> "PaddedRows | None":
        """From ``order`` [N] (rows sorted by slot) and ``counts`` [num_slots]; None when padding would
        more than double the rows. order [0, 3, 4, 5], counts [1, 0, 2, 1] -> slots 0..3 padded to 2."""
        present = np.flatnonzero(counts)
        first, end = int(present[0]), int(present[-1]) + 1
        per_slot = int(counts.max())
        if (end - first) * per_slot > MAX_PADDING_FACTOR * len(order):
            return None
        counts = counts[first:end]
        position = np.arange(len(order)) - np.repeat(np.cumsum(counts) - counts, counts)  # index within its slot
        rows = np.zeros((end - first, per_slot), dtype=np.int64)
        rows[np.repeat(np.arange(end - first), counts), position] = order
        pads = np.arange(per_slot)[None, :] >= counts[:, None]  # [P, M]
        if not pads.any():
            in_place = bool((rows.reshape(-1) == np.arange(rows.size)).all())
            return cls(first, end, per_slot, None if in_place else put(rows.reshape(-1)), None)
        return cls(first, end, per_slot, put(rows.reshape(-1)), put(pads[:, :, None]))


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
    padded: PaddedRows | None  # the same rows padded per slot; None without them or when padding does not pay
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

        padded = PaddedRows.build(order, counts, put) if count else None
        return cls(put(slots), num_slots, segments, None if in_place else put(order), put(ends.astype(np.int32)), runs,
                   padded)

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
