"""LoRABatch: which adapter slot each token of a step runs with; set and reset by the model
runner around the forward pass, read by every LoRA linear (as attention reads its metadata).

    sequences [A: 2 tokens on slot 1, B: 1 token on the base, C: 3 tokens on slot 0]
    token_slots [1, 1, -1, 0, 0, 0]; groups [(0, [3, 4, 5]), (1, [0, 1])]
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Iterator

import torch


@dataclass
class LoRABatch:
    token_slots: torch.Tensor  # [T] int64, -1: the base model (no adapter)
    num_slots: int  # --max-loras
    _masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, token_slots: torch.Tensor, num_slots: int) -> "LoRABatch":
        return cls(token_slots, num_slots)

    @functools.cached_property
    def groups(self) -> list[tuple[int, torch.Tensor]]:
        """(slot, [n] token rows on it) for each slot present, once per step, for the kernels that
        group (it reads the slots on the host; masked_dense never asks)."""
        present = torch.unique(self.token_slots).tolist()
        return [(slot, torch.nonzero(self.token_slots == slot).flatten()) for slot in present if slot >= 0]

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
