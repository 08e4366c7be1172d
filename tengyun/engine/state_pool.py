"""StatePool: slot ids for per-sequence recurrent state (hybrid models' linear-attention layers).

Each running sequence of a hybrid model owns one slot: row ``slot`` of every Gated DeltaNet
layer's conv and SSM state tensors on the worker. Pure Python: the worker owns the tensors.
"""

from __future__ import annotations


class StatePool:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._slot_of: dict[int, int] = {}  # seq_id -> slot

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self, seq_id: int) -> int:
        assert seq_id not in self._slot_of, f"sequence {seq_id} already holds slot {self._slot_of[seq_id]}"
        slot = self._free.pop()
        self._slot_of[seq_id] = slot
        return slot

    def free(self, seq_id: int) -> None:
        """Return the sequence's slot; a sequence without one (waiting, already freed) is a no-op."""
        slot = self._slot_of.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def slot_of(self, seq_id: int) -> int | None:
        return self._slot_of.get(seq_id)
