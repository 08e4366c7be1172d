"""Where adapters are kept between steps: device slots (--max-loras) and host copies
(--max-cpu-loras), each evicting the least recently used. Torch-free: the worker's LoRAManager
(tengyun/layers/lora/manager.py) owns the tensors and asks these which to load or drop.

    slots = AdapterSlots(2)
    slots.assign({7, 9}) -> [(7, 0), (9, 1)]   # both loaded
    slots.assign({9})    -> []                 # 9 stays in slot 1
    slots.assign({9, 4}) -> [(4, 0)]           # 7, the least recently used, leaves slot 0
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

V = TypeVar("V")


class AdapterSlots:
    """lora_int_id -> device slot in [0, num_slots); a step's adapters are never evicted by it."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # least recently used first
        self._free = list(range(num_slots))

    def assign(self, adapter_ids: set[int]) -> list[tuple[int, int]]:
        """Give every adapter of one step a slot; -> the (adapter, slot) pairs whose weights must be
        written now. The scheduler keeps a step to at most num_slots adapters (--max-loras)."""
        if len(adapter_ids) > self.num_slots:
            raise ValueError(f"{len(adapter_ids)} adapters in one step but --max-loras is {self.num_slots}.")
        for adapter in adapter_ids & self.slot_of.keys():
            self.slot_of.move_to_end(adapter)
        loads = []
        for adapter in sorted(adapter_ids - self.slot_of.keys()):
            if self._free:
                slot = self._free.pop(0)
            else:  # the least recently used adapter this step does not need
                victim = next(a for a in self.slot_of if a not in adapter_ids)
                slot = self.slot_of.pop(victim)
            self.slot_of[adapter] = slot
            loads.append((adapter, slot))
        return loads

    def remove(self, adapter_id: int) -> None:
        slot = self.slot_of.pop(adapter_id, None)
        if slot is not None:
            self._free.append(slot)


class HostCache(Generic[V]):
    """At most ``capacity`` values, the least recently used dropped first (--max-cpu-loras)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[Hashable, V] = OrderedDict()

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        """The value for ``key``, made (and the oldest dropped past capacity) when not held."""
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = make()
        self._items[key] = value
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return value

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)
