"""BlockManager.fork and copy on write (beam search): a forked sequence references its parent's
blocks; the first write into a shared, partly filled block takes a copy; freeing every holder
frees every block."""

from __future__ import annotations

import pytest

from tengyun.engine.block_manager import BlockManager
from tengyun.engine.sequence import Sequence
from tengyun.sampling_params import SamplingParams

BLOCK = 4


def _computed(seq_id: int, tokens: list[int], bm: BlockManager) -> Sequence:
    """A sequence whose tokens all have KV."""
    seq = Sequence(seq_id, "r", 0, list(tokens), SamplingParams(), arrival_order=seq_id)
    bm.allocate(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    return seq


def _child(seq_id: int, parent: Sequence, token: int, bm: BlockManager) -> Sequence:
    child = Sequence(seq_id, "r", 0, parent.prompt_token_ids, SamplingParams(), arrival_order=seq_id,
                     token_ids=parent.token_ids + [token])
    bm.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens
    return child


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_children_share_full_blocks_and_copy_the_partial_one_on_write(prefix_caching):
    bm = BlockManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=prefix_caching)
    parent = _computed(0, [1, 2, 3, 4, 5, 6], bm)  # blocks [full, 2 of 4]
    full, partial = parent.block_table
    a, b = _child(1, parent, 7, bm), _child(2, parent, 8, bm)
    bm.free(parent)
    assert [bm.blocks[i].ref_count for i in (full, partial)] == [2, 2]
    assert bm.can_allocate(a, 1) and bm.num_free_blocks == 6
    bm.allocate(a, 1)  # a writes position 6 into the shared partial block: a copy first
    assert a.block_table[0] == full and a.block_table[1] not in (full, partial)
    assert bm.take_copies() == [(partial, a.block_table[1])] and bm.take_copies() == []
    bm.allocate(b, 1)  # b is the partial block's last holder: it writes in place
    assert b.block_table == [full, partial] and bm.take_copies() == []
    for seq in (a, b):
        bm.free(seq)
    assert bm.num_free_blocks == 8 and all(block.ref_count == 0 for block in bm.blocks)


def test_a_token_that_starts_a_block_copies_nothing():
    bm = BlockManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    parent = _computed(0, [1, 2, 3, 4], bm)  # one full block
    a, b = _child(1, parent, 5, bm), _child(2, parent, 6, bm)
    bm.allocate(a, 1)
    bm.allocate(b, 1)
    assert bm.take_copies() == [] and a.block_table[0] == b.block_table[0] == parent.block_table[0]
    assert a.block_table[1] != b.block_table[1]


def test_a_copy_needs_a_free_block():
    bm = BlockManager(num_blocks=2, block_size=BLOCK, enable_prefix_caching=False)
    parent = _computed(0, [1, 2, 3, 4, 5], bm)  # both blocks used
    child = _child(1, parent, 6, bm)
    assert not bm.can_allocate(child, 1)  # position 5 is in the shared block: a copy, and no block free
    bm.free(parent)
    assert bm.can_allocate(child, 1)  # now child alone holds it: written in place
