"""BlockManager: the paged KV cache's block pool, with automatic prefix caching.

A block holds ``block_size`` consecutive tokens of one sequence. A full block is identified
by hash(parent block's hash, its token ids); identical prefixes therefore map to the same
chain of hashes and share blocks. A sequence's first block hangs off its LoRA adapter's root
(``root_hash``): the same tokens under another adapter (or the base model) have other KV, so
chains of different adapters never meet. Blocks whose reference count drops to zero keep their
hash and stay reusable until they are evicted, least recently freed first.

Beam search forks a sequence (``fork``): the child references every block of its parent. A
block is written by at most one sequence: before a sequence writes into a partly filled block
others reference too, it gets a copy of it (``allocate``'s copy on write; the worker copies the
KV of ``take_copies()`` before the step's forward pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tengyun.engine.free_block_queue import FreeBlockQueue
from tengyun.engine.sequence import Sequence

_NO_PARENT = 0
_LORA_ROOT = -1  # root_hash's tag


def blocks_to_keep(num_computed_tokens: int, block_size: int) -> int:
    """Blocks a sequence keeps after speculative drafts were rejected: those holding its computed
    tokens (the worker trims its copy of the block table by the same rule). 17 tokens, 8 per block -> 3."""
    return -(-num_computed_tokens // block_size)


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    # Python's tuple-of-int hash is deterministic (no PYTHONHASHSEED salt for ints).
    return hash((parent_hash, token_ids))


def root_hash(seq: Sequence) -> int:
    """The parent hash of a sequence's first block: 0 for the base model, else its adapter's id
    hashed with a tag no token tuple produces."""
    lora = seq.lora_request
    return _NO_PARENT if lora is None else hash((_LORA_ROOT, lora.lora_int_id))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    # Kept for the collision check: a hit must match the tokens and the parent's hash.
    token_ids: tuple[int, ...] = ()
    parent_hash: int = _NO_PARENT

    def reset(self) -> None:
        self.ref_count = 0
        self.block_hash = None
        self.token_ids = ()
        self.parent_hash = _NO_PARENT


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[Block] = []  # blocks[i] is block i, for every id taken at least once
        self.free_queue = FreeBlockQueue(num_blocks)  # ref_count == 0 blocks; the front is evicted first
        self.hash_to_block: dict[int, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies for the next step
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found
        # Called with a block's hash when the block leaves the prefix cache (hybrid models drop
        # the recurrent-state snapshot kept with it: engine/state_snapshots.py).
        self.on_evict: Callable[[int], None] | None = None

    # ----- queries ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a sequence (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    # ----- prefix cache lookup ------------------------------------------------------------
    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq``; at least one token is left
        to compute so the sequence still produces logits. No hit for a sequence that must
        compute its whole prompt (prompt logprobs); its full blocks still serve others."""
        if not self.enable_prefix_caching or not seq.uses_prefix_cache:
            return []
        num_lookup_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, num_lookup_blocks)
        hits: list[int] = []
        for i in range(num_lookup_blocks):
            block_id = self.hash_to_block.get(seq.block_hashes[i])
            if block_id is None or not self._holds(block_id, seq, i):
                break
            hits.append(block_id)
        return hits

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup once, when its sequence is admitted (not on every retry)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_queried_tokens
            self.prefix_hits += num_hit_tokens

    # ----- allocation -------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        # Cached blocks that sit in the free queue are taken out of it, so they cost a slot too.
        reused_free = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        cached_tokens = len(cached_blocks) * self.block_size
        new_blocks = self.blocks_needed(seq, cached_tokens + num_new_tokens) - len(cached_blocks)
        copies = 1 if num_new_tokens and self._shared_write_block(seq) is not None else 0
        return new_blocks + reused_free + copies <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = (),
                 num_unverified: int = 0) -> None:
        """Give ``seq`` blocks for tokens up to num_computed + cached + num_new_tokens.

        ``cached_blocks`` (from find_cached_blocks, first schedule only) are shared, and the
        caller advances num_computed_tokens past them. Blocks that become full with this step's
        tokens are registered in the prefix cache right away: their KV is written in the same
        forward pass, before any attention reads it. The last ``num_unverified`` new tokens are
        speculative drafts: blocks they fill are registered once the drafts are accepted.
        """
        assert self.can_allocate(seq, num_new_tokens, cached_blocks)
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_queue.remove(block_id)
            block.ref_count += 1
            seq.block_table.append(block_id)
        if num_new_tokens:
            self._copy_on_write(seq)
        for _ in range(self.blocks_needed(seq, num_new_tokens + len(cached_blocks) * self.block_size)):
            seq.block_table.append(self._take_free_block())
        if self.enable_prefix_caching and seq.prompt_embeds is None:  # placeholder ids: nothing to share
            cached_tokens = len(cached_blocks) * self.block_size
            num_full = (seq.num_computed_tokens + cached_tokens + num_new_tokens - num_unverified) // self.block_size
            self._register_full_blocks(seq, num_full)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (parent's tokens and more) references every block of ``parent``."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references. Tail blocks go to the front of the eviction queue
        (least useful to others), unhashed blocks too; hashed blocks stay reusable."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.push_front(block_id)
                else:
                    self.free_queue.push_back(block_id)
        seq.block_table.clear()

    def roll_back(self, seq: Sequence) -> None:
        """Free the blocks past ``seq``'s computed tokens: the tail that held rejected drafts.
        Those blocks were never registered (allocate's num_unverified), so nothing cached goes."""
        keep = blocks_to_keep(seq.num_computed_tokens, self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.block_hash is None, f"rolled back block {block_id} is shared"
            self.free_queue.push_front(block_id)
        del seq.block_table[keep:]

    # ----- internals --------------------------------------------------------------------
    def _shared_write_block(self, seq: Sequence) -> int | None:
        """Index in seq's block table of the partly filled block its next token goes to, when other
        sequences reference it too (forked beams); else None. 8 tokens a block, 13 computed ->
        block 1, if shared; 16 computed -> None (the next token starts a new block)."""
        index, offset = divmod(seq.num_computed_tokens, self.block_size)
        if offset and index < len(seq.block_table) and self.blocks[seq.block_table[index]].ref_count > 1:
            return index
        return None

    def _copy_on_write(self, seq: Sequence) -> None:
        index = self._shared_write_block(seq)
        if index is None:
            return
        src = self.blocks[seq.block_table[index]]
        src.ref_count -= 1  # still >= 1: another sequence keeps it
        dst = self._take_free_block()
        seq.block_table[index] = dst
        self.pending_copies.append((src.block_id, dst))

    def _take_free_block(self) -> int:
        block_id = self.free_queue.pop_front()
        if block_id == len(self.blocks):  # never used: ids leave that run in increasing order
            self.blocks.append(Block(block_id))
        block = self.blocks[block_id]
        if block.block_hash is not None and self.hash_to_block.get(block.block_hash) == block_id:
            del self.hash_to_block[block.block_hash]
            if self.on_evict is not None:
                self.on_evict(block.block_hash)
        block.reset()
        block.ref_count = 1
        return block_id

    def _holds(self, block_id: int, seq: Sequence, index: int) -> bool:
        block = self.blocks[block_id]
        parent = seq.block_hashes[index - 1] if index else root_hash(seq)
        return block.parent_hash == parent and block.token_ids == self._block_tokens(seq, index)

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[index * self.block_size:(index + 1) * self.block_size])

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        while len(seq.block_hashes) < num_blocks:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else root_hash(seq)
            seq.block_hashes.append(hash_block(parent, self._block_tokens(seq, i)))

    def _register_full_blocks(self, seq: Sequence, num_full: int) -> None:
        self._extend_hashes(seq, num_full)
        for i in range(num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                continue
            block.block_hash = seq.block_hashes[i]
            block.token_ids = self._block_tokens(seq, i)
            block.parent_hash = seq.block_hashes[i - 1] if i else root_hash(seq)
            # First writer wins; a duplicate block with the same content simply stays private.
            self.hash_to_block.setdefault(block.block_hash, block.block_id)
