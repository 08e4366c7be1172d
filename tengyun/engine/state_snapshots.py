"""StateSnapshots: the prefix cache's recurrent-state half for hybrid models (pure Python).

A KV block cannot rebuild a Gated DeltaNet layer's state, so a prefix-cache hit on a hybrid model
also needs the state after the hit point. A snapshot row (rows of the worker's state tensors
beyond the running slots) holds every linear-attention layer's conv and SSM state after the
tokens [0, (i + 1) * block_size) of a sequence, keyed by the hash of its full block i (the hash
covers the whole prefix, so equal hashes mean equal states). Invariants:

- a hit is the longest cached KV prefix whose last block has a ready snapshot;
- copy-on-restore: the worker copies the row into the sequence's own slot before the step; the
  sequence then updates only its slot, so no sequence's update reaches a row or another slot;
- a row is written by the worker after the step whose chunk ended on that block boundary
  (``saves``: slot -> row) and is hittable only once that step ran (``commit``); a sequence
  that would hit it waits for that step rather than compute the same prefix beside it;
- a row is dropped when its block leaves the prefix cache (``evict``) and reused least recently
  used first when none is free; a row being written is never reused in the same step.

Snapshots exist only where a step ends on a block boundary, so the scheduler aligns prefill
chunks (``align_chunk``): a chunk cut by the token budget ends on a block boundary, the prompt's
last partial block runs as its own step, and a prompt whose cached KV reaches past its last
snapshot stops its first chunk at the end of that KV (where it leaves the shared prefix).
"""

from __future__ import annotations

from collections import OrderedDict

from tengyun.engine.sequence import Sequence


class StateSnapshots:
    def __init__(self, num_rows: int, block_size: int):
        self.num_rows = num_rows
        self.block_size = block_size
        self._free = list(range(num_rows - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._ready: OrderedDict[int, int] = OrderedDict()  # block hash -> row; least recently used first
        self._pending: dict[int, int] = {}  # block hash -> row the step in flight writes
        self._free_after_step: list[int] = []  # rows of evicted pending snapshots, still being written
        # This step's copies, read by the worker: (row, slot) before the model, (slot, row) after it.
        self.restores: list[tuple[int, int]] = []
        self.saves: list[tuple[int, int]] = []

    @property
    def num_cached(self) -> int:
        return len(self._ready) + len(self._pending)

    # ----- lookup ---------------------------------------------------------------------------
    def trim_hit(self, seq: Sequence, cached_blocks: list[int]) -> list[int]:
        """The longest prefix of ``cached_blocks`` whose last block has a ready snapshot (maybe
        none). ``cached_blocks`` come from BlockManager.find_cached_blocks, which hashed them."""
        for n in range(len(cached_blocks), 0, -1):
            if seq.block_hashes[n - 1] in self._ready:
                return cached_blocks[:n]
        return []

    def writes_longer_hit(self, seq: Sequence, num_hit_blocks: int, num_cached_blocks: int) -> bool:
        """Whether this step writes a snapshot after one of ``seq``'s cached blocks past its hit:
        then ``seq`` had better wait a step for it than compute the prefix again."""
        return any(h in self._pending for h in seq.block_hashes[num_hit_blocks:num_cached_blocks])

    def restore(self, seq: Sequence, num_hit_blocks: int, slot: int) -> None:
        """Copy the snapshot after ``seq``'s first ``num_hit_blocks`` blocks (a trim_hit result)
        into ``slot`` before this step; it becomes the most recently used."""
        block_hash = seq.block_hashes[num_hit_blocks - 1]
        self._ready.move_to_end(block_hash)
        self.restores.append((self._ready[block_hash], slot))

    # ----- chunking ---------------------------------------------------------------------------
    def align_chunk(self, seq: Sequence, start: int, num_new: int, kv_hit_tokens: int = 0) -> int:
        """Tokens to compute from ``start`` so the chunk ends where a snapshot is worth taking.
        block_size 16, 100 prompt tokens: budget 40 -> [0, 32), [32, 64), [64, 96), [96, 100);
        budget 512 -> [0, 96), [96, 100). A hit of 32 tokens with cached KV up to 64 -> [32, 64)
        first. Decodes and chunks shorter than a block are left alone."""
        if _is_decode(seq, start) or not self.num_rows:
            return num_new  # no snapshots to take
        end, bs = start + num_new, self.block_size
        if start < kv_hit_tokens < end:
            return kv_hit_tokens - start
        last_boundary = seq.num_tokens // bs * bs
        if start < last_boundary < end:
            return last_boundary - start
        if end < seq.num_tokens and end // bs * bs > start:
            return end // bs * bs - start
        return num_new

    # ----- saving -----------------------------------------------------------------------------
    def save_after(self, seq: Sequence, slot: int, start: int, num_new: int) -> None:
        """Snapshot ``slot`` after this step when the prefill chunk [start, start + num_new) ends on
        a block boundary whose block is hashed and has no snapshot yet."""
        end = start + num_new
        if end % self.block_size or _is_decode(seq, start):
            return
        index = end // self.block_size - 1
        if index >= len(seq.block_hashes):
            return
        block_hash = seq.block_hashes[index]
        if block_hash in self._pending or block_hash in self._ready:
            return
        row = self._take_row()
        if row is not None:
            self._pending[block_hash] = row
            self.saves.append((slot, row))

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (restores, saves) for the worker's message; the next step starts empty."""
        copies = self.restores, self.saves
        self.restores, self.saves = [], []
        return copies

    def commit(self) -> None:
        """The step ran: the snapshots it wrote become hittable."""
        self._ready.update(self._pending)
        self._pending.clear()
        self._free += self._free_after_step
        self._free_after_step.clear()

    # ----- eviction ---------------------------------------------------------------------------
    def evict(self, block_hash: int) -> None:
        """The block with this hash left the prefix cache: its snapshot goes with it."""
        if block_hash in self._ready:
            self._free.append(self._ready.pop(block_hash))
        elif block_hash in self._pending:
            self._free_after_step.append(self._pending.pop(block_hash))

    def _take_row(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._ready:  # the least recently used snapshot; pending rows are being written
            _, row = self._ready.popitem(last=False)
            return row
        return None


def _is_decode(seq: Sequence, start: int) -> bool:
    """A step from ``start`` computes only the newest token (a resumed sequence's outputs are prefill)."""
    return start >= max(seq.num_prompt_tokens, seq.num_tokens - 1)
