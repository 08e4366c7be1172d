"""BlockManager invariants under random allocate / append / free / preempt (hypothesis),
plus exact tests of prefix hits and LRU eviction."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tengyun.engine.block_manager import BlockManager
from tengyun.engine.sequence import Sequence
from tengyun.sampling_params import SamplingParams

BLOCK = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]


def _seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, str(seq_id), 0, list(tokens), SamplingParams(), arrival_order=seq_id)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=BLOCK, enable_prefix_caching=True)
        self.seqs: dict[int, Sequence] = {}
        self.started: set[int] = set()
        self.content: dict[int, dict[int, int]] = {}  # block -> {offset: token} as written by compute
        self.next_id = 0

    # ----- rules --------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=9))
    def add(self, prefix, tail):
        self.seqs[self.next_id] = _seq(self.next_id, prefix + tail)
        self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def compute(self, data, chunk):
        seq = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        cached = []
        if seq.seq_id not in self.started:
            cached = self.bm.find_cached_blocks(seq)
            for i, block_id in enumerate(cached):  # a hit holds exactly these tokens
                expected = seq.token_ids[i * BLOCK:(i + 1) * BLOCK]
                assert [self.content[block_id][o] for o in range(BLOCK)] == expected
        start = seq.num_computed_tokens + len(cached) * BLOCK
        n = min(chunk, seq.num_tokens - start)
        if n <= 0 or not self.bm.can_allocate(seq, n, cached):
            return
        self.bm.allocate(seq, n, cached)
        self.started.add(seq.seq_id)
        for pos in range(start, start + n):  # the forward pass writes these slots
            block_id = seq.block_table[pos // BLOCK]
            self.content.setdefault(block_id, {})[pos % BLOCK] = seq.token_ids[pos]
        seq.num_computed_tokens = start + n

    @precondition(lambda self: any(s.num_uncomputed_tokens == 0 for s in self.seqs.values()))
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        done = sorted(i for i, s in self.seqs.items() if s.num_uncomputed_tokens == 0)
        self.seqs[data.draw(st.sampled_from(done))].append_token(token)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq = self.seqs.pop(data.draw(st.sampled_from(sorted(self.seqs))))
        self.bm.free(seq)
        self.started.discard(seq.seq_id)

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def preempt(self, data):
        seq = self.seqs[data.draw(st.sampled_from(sorted(self.started)))]
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        self.started.discard(seq.seq_id)

    # ----- invariants ---------------------------------------------------------------------
    @invariant()
    def ref_counts_equal_owners(self):
        owners = Counter(b for s in self.seqs.values() for b in s.block_table)
        for block in self.bm.blocks:
            assert block.ref_count == owners.get(block.block_id, 0)

    @invariant()
    def no_block_twice_in_one_table(self):
        for seq in self.seqs.values():
            assert len(seq.block_table) == len(set(seq.block_table))

    @invariant()
    def free_plus_used_is_total(self):
        used = {b for s in self.seqs.values() for b in s.block_table}
        assert set(self.bm.free_queue).isdisjoint(used)
        assert len(self.bm.free_queue) + len(used) == self.bm.num_blocks

    @invariant()
    def hash_map_points_at_matching_blocks(self):
        for block_hash, block_id in self.bm.hash_to_block.items():
            assert self.bm.blocks[block_id].block_hash == block_hash


TestBlockManagerInvariants = BlockManagerMachine.TestCase
TestBlockManagerInvariants.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_prefix_hit_skips_cached_blocks_and_counts_tokens():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = _seq(0, list(range(10)))  # blocks [0..3], [4..7] full, [8, 9] partial
    bm.allocate(first, 10)
    second = _seq(1, list(range(8)) + [42, 43, 44])
    hits = bm.find_cached_blocks(second)
    assert hits == first.block_table[:2]
    bm.record_prefix_lookup(second.num_tokens, len(hits) * 4)
    assert (bm.prefix_queries, bm.prefix_hits) == (11, 8)
    bm.allocate(second, 3, hits)
    assert second.block_table[:2] == first.block_table[:2]
    assert [bm.blocks[b].ref_count for b in hits] == [2, 2]


def test_full_prompt_hit_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    bm.allocate(_seq(0, list(range(8))), 8)
    assert len(bm.find_cached_blocks(_seq(1, list(range(8))))) == 1  # 7 lookup tokens -> 1 full block


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = _seq(0, [1, 2, 3, 4])
    bm.allocate(a, 4)
    bm.free(a)
    assert bm.num_free_blocks == 4
    assert bm.find_cached_blocks(_seq(1, [1, 2, 3, 4, 5])) == [0, 1]
    # Needing all four blocks evicts the cached ones too.
    b = _seq(2, [9] * 8)
    bm.allocate(b, 8)
    assert bm.find_cached_blocks(_seq(3, [1, 2, 3, 4, 5])) == []


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    bm.allocate(_seq(0, list(range(9))), 9)
    assert bm.find_cached_blocks(_seq(1, list(range(9)))) == []


def test_prompt_logprobs_sequence_takes_no_hit_but_its_blocks_serve_others():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    scoring = Sequence(0, "0", 0, list(range(9)), SamplingParams(prompt_logprobs=2), arrival_order=0)
    bm.allocate(scoring, 9)
    assert bm.find_cached_blocks(_seq(1, list(range(9)))) == scoring.block_table[:2]
    again = Sequence(2, "2", 0, list(range(9)), SamplingParams(prompt_logprobs=0), arrival_order=2)
    assert not again.uses_prefix_cache
    assert bm.find_cached_blocks(again) == []  # every prompt position must produce logits
