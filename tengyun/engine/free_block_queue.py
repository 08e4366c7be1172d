"""FreeBlockQueue: the KV blocks no sequence references, in the order they are taken.

The order is three runs, taken from the front:

    [freed without a hash, newest first] [never used: next_unused ..] [freed with a hash, oldest first]

A block freed without a hash holds nothing anyone can reuse, so it is taken first; a hashed
block stays in the prefix cache until it is taken, so the least recently freed goes first and
only after every never-used block. The never-used run is a counter, not a million entries: a
4 GiB cache of a tiny model has ~1M blocks, and listing them cost ~2 s at every engine start.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class FreeBlockQueue:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.next_unused = 0  # ids next_unused .. num_blocks-1 were never taken
        self._front: OrderedDict[int, None] = OrderedDict()  # freed without a hash; the first is taken first
        self._back: OrderedDict[int, None] = OrderedDict()  # freed with a hash; the first is taken first

    def __len__(self) -> int:
        return len(self._front) + (self.num_blocks - self.next_unused) + len(self._back)

    def __iter__(self) -> Iterator[int]:
        """Block ids in the order pop_front takes them."""
        yield from self._front
        yield from range(self.next_unused, self.num_blocks)
        yield from self._back

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._front or block_id in self._back or self.next_unused <= block_id < self.num_blocks

    def pop_front(self) -> int:
        """The next block to take; IndexError when none is free."""
        if self._front:
            return self._front.popitem(last=False)[0]
        if self.next_unused < self.num_blocks:
            self.next_unused += 1
            return self.next_unused - 1
        if self._back:
            return self._back.popitem(last=False)[0]
        raise IndexError("no free KV block")

    def push_front(self, block_id: int) -> None:
        """A block freed without a hash: taken before any other."""
        self._front[block_id] = None
        self._front.move_to_end(block_id, last=False)

    def push_back(self, block_id: int) -> None:
        """A block freed with a hash: taken after every block freed before it."""
        self._back[block_id] = None

    def remove(self, block_id: int) -> None:
        """Take a given freed block out of the queue (a prefix-cache hit on a block no one references)."""
        if block_id in self._back:
            del self._back[block_id]
        elif block_id in self._front:
            del self._front[block_id]
        else:
            raise KeyError(f"block {block_id} is not a freed block")
