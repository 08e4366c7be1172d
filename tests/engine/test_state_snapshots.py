"""Hybrid prefix caching's engine half (engine/state_snapshots.py) with the real Scheduler: chunks
end on block boundaries, a hit restores the snapshot at its last block only once that snapshot
was written, snapshots leave with their blocks, and a hypothesis state machine that plays the
worker (a slot's "state" is the exact token prefix it has consumed) finds no slot starting a chunk
from anything but its own prefix, and no snapshot row holding anything but its block's prefix."""

from __future__ import annotations

import random
from types import SimpleNamespace

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tengyun.engine.block_manager import hash_block
from tengyun.engine.scheduler import Scheduler
from tengyun.engine.sequence import Sequence, SequenceStatus
from tengyun.engine.state_snapshots import StateSnapshots
from tengyun.sampling_params import SamplingParams

BS = 4


def _config(budget: int = 64, max_num_seqs: int = 8):
    return SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=True,
                           block_size=BS, enable_prefix_caching=True)


def _seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, str(seq_id), 0, list(tokens), SamplingParams(), arrival_order=seq_id)


def _run_to_end(sched: Scheduler, seqs: dict[int, Sequence], steps: int = 50) -> list:
    """Steps until every sequence has computed its prompt; returns each step's SchedulerOutput."""
    outs = []
    for _ in range(steps):
        out = sched.schedule()
        if out.is_empty:
            break
        sched.advance(out, seqs)
        outs.append(out)
    return outs


def test_chunks_end_on_block_boundaries_and_the_last_partial_block_runs_alone():
    seq = _seq(0, list(range(1, 19)))  # 18 tokens, blocks of 4
    snapshots = StateSnapshots(4, BS)
    assert snapshots.align_chunk(seq, 0, 18) == 16  # [0, 16) then [16, 18)
    assert snapshots.align_chunk(seq, 16, 2) == 2
    assert snapshots.align_chunk(seq, 0, 10) == 8  # a budget cut rounds down to a boundary
    assert snapshots.align_chunk(seq, 0, 3) == 3  # shorter than a block: left alone
    assert snapshots.align_chunk(seq, 4, 14, kv_hit_tokens=12) == 8  # stops where the cached KV ends
    seq.num_computed_tokens = 18
    seq.append_token(5)
    assert snapshots.align_chunk(seq, 18, 1) == 1  # a decode


def test_a_hit_restores_the_snapshot_of_its_last_block_once_written():
    sched = Scheduler(_config(), num_blocks=32, num_state_slots=3, num_state_snapshots=3)
    shared = [9, 8, 7, 6, 5, 4, 3, 2]  # two blocks
    seqs = {0: _seq(0, shared + [1, 1, 1]), 1: _seq(1, shared + [2, 2])}
    sched.add(seqs[0])
    sched.add(seqs[1])
    first = sched.schedule()
    # The partial last block waits for the next step. Seq 1 finds seq 0's KV but the snapshot
    # after it is written by this step: it waits for it rather than compute the same 8 tokens.
    assert first.num_scheduled_tokens == {0: 8}
    assert first.state_saves == [(0, 0)] and first.state_restores == []
    sched.advance(first, seqs)
    second = sched.schedule()
    assert [(n.seq_id, n.num_computed_tokens, n.state_slot) for n in second.new_seqs] == [(1, 8, 1)]
    assert second.state_restores == [(0, 1)]  # row 0 copied into seq 1's own slot
    assert second.num_scheduled_tokens == {0: 3, 1: 2}
    assert sched.block_manager.prefix_hits == 8


def test_prefix_without_a_snapshot_is_no_hit_but_its_end_gets_one():
    """Seq 0 (prompt 12) leaves a snapshot after 12 tokens only; seq 1 shares 8 tokens: its KV is
    cached but no state after it, so seq 1 computes from 0 and stops at 8 to snapshot there."""
    sched = Scheduler(_config(), num_blocks=32, num_state_slots=2, num_state_snapshots=2)
    seqs = {0: _seq(0, list(range(1, 13)) + [50])}
    sched.add(seqs[0])
    _run_to_end(sched, seqs)
    seqs[1] = _seq(1, list(range(1, 9)) + [60, 61, 62])
    sched.add(seqs[1])
    out = sched.schedule()
    assert out.new_seqs[0].num_computed_tokens == 0 and out.num_scheduled_tokens[1] == 8
    assert out.state_saves == [(1, 1)]


def test_snapshots_leave_with_their_blocks_and_the_least_recently_used_goes_first():
    snapshots = StateSnapshots(2, BS)
    a, b, c = (_seq(i, [i] * 9) for i in range(3))
    for seq, slot in ((a, 0), (b, 1), (c, 0)):
        seq.block_hashes = [hash_block(0, tuple(seq.token_ids[:BS])), 1000 + seq.seq_id]
        snapshots.save_after(seq, slot, 0, BS)
        snapshots.commit()
    assert snapshots.take_copies()[1] == [(0, 0), (1, 1), (0, 0)]  # c took a's row (least recently used)
    assert snapshots.trim_hit(a, [3, 4]) == [] and snapshots.trim_hit(c, [3, 4]) == [3]
    snapshots.evict(c.block_hashes[0])
    assert snapshots.trim_hit(c, [3, 4]) == [] and snapshots.num_cached == 1


def test_evicting_a_block_drops_its_snapshot():
    sched = Scheduler(_config(), num_blocks=4, num_state_slots=2, num_state_snapshots=2)
    seqs = {0: _seq(0, [1, 2, 3, 4, 5])}
    sched.add(seqs[0])
    _run_to_end(sched, seqs)
    sched.finish(seqs[0])
    assert sched.snapshots.num_cached == 1
    seqs[1] = _seq(1, list(range(20, 36)))  # 16 tokens: all 4 blocks, the cached one too
    sched.add(seqs[1])
    out = sched.schedule()
    assert out.state_saves == [(0, 0)]  # the evicted block's row was freed, then reused
    assert sched.snapshots.num_cached == 1 and sched.snapshots.trim_hit(seqs[0], [0]) == []


def test_no_snapshot_rows_means_no_hits_on_a_hybrid_model():
    """Prefix caching on, but the budget left no snapshot row: cached KV alone would resume from
    whatever state the slot last held, so a hybrid model takes no hit at all."""
    sched = Scheduler(_config(), num_blocks=32, num_state_slots=2, num_state_snapshots=0)
    seqs = {0: _seq(0, list(range(1, 11)))}
    sched.add(seqs[0])
    _run_to_end(sched, seqs)
    sched.finish(seqs[0])
    seqs[1] = _seq(1, list(range(1, 11)))
    sched.add(seqs[1])
    out = sched.schedule()
    assert out.new_seqs[0].num_computed_tokens == 0 and out.num_scheduled_tokens == {1: 10}
    assert sched.block_manager.prefix_hits == 0


class SimulatedHybridWorker(RuleBasedStateMachine):
    """The real Scheduler against a worker whose recurrent state is the token prefix itself: a
    slot or snapshot row holds the tuple of tokens its state has consumed. A hit is only correct
    if the restored row holds exactly the hit's prefix; any sharing or stale row shows up."""

    def __init__(self):
        super().__init__()
        self.sched = Scheduler(_config(budget=10, max_num_seqs=4), num_blocks=14, num_state_slots=3,
                               num_state_snapshots=2)
        self.seqs: dict[int, Sequence] = {}
        self.slots: dict[int, tuple] = {}  # slot -> consumed tokens
        self.rows: dict[int, tuple] = {}  # snapshot row -> consumed tokens
        self.next_id = 0
        rng = random.Random(0)
        self.prefixes = [[rng.randrange(1, 9) for _ in range(n)] for n in (4, 8, 11)]

    @rule(prefix=st.integers(0, 3), suffix=st.lists(st.integers(1, 8), min_size=1, max_size=6))
    def add(self, prefix, suffix):
        tokens = (self.prefixes[prefix] if prefix < 3 else []) + suffix
        seq = _seq(self.next_id, tokens)
        self.seqs[seq.seq_id] = seq
        self.sched.add(seq)
        self.next_id += 1

    @rule()
    def step(self):
        out = self.sched.schedule()
        for row, slot in out.state_restores:
            self.slots[slot] = self.rows[row]
        starts = {new.seq_id: new.num_computed_tokens for new in out.new_seqs}
        starts |= {c.seq_id: c.num_computed_tokens for c in out.cached_seqs}
        for seq_id, n in out.num_scheduled_tokens.items():
            seq, start = self.seqs[seq_id], starts[seq_id]
            slot = self.sched.state_pool.slot_of(seq_id)
            state = self.slots.get(slot, ()) if start else ()  # a chunk at position 0 starts from zeros
            assert state == tuple(seq.token_ids[:start]), f"seq {seq_id} starts at {start} from another state"
            self.slots[slot] = tuple(seq.token_ids[:start + n])
        for slot, row in out.state_saves:
            self.rows[row] = self.slots[slot]
        self.sched.advance(out, self.seqs)
        for seq_id in out.num_scheduled_tokens:
            seq = self.seqs[seq_id]
            if seq.num_uncomputed_tokens == 0:  # the "model" is greedy on its prefix: same prefix, same token
                seq.append_token(1 + hash(tuple(seq.token_ids)) % 8)

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def finish_running(self, data):
        self.sched.finish(data.draw(st.sampled_from(self.sched.running)))

    @precondition(lambda self: self.sched.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data):
        self.sched.finish(data.draw(st.sampled_from(list(self.sched.waiting))))

    @invariant()
    def every_ready_snapshot_holds_its_blocks_prefix(self):
        for block_hash, row in self.sched.snapshots._ready.items():
            tokens, chain = self.rows[row], 0
            assert len(tokens) % BS == 0
            for i in range(0, len(tokens), BS):
                chain = hash_block(chain, tokens[i:i + BS])
            assert chain == block_hash

    @invariant()
    def running_sequences_hold_distinct_slots(self):
        slots = [self.sched.state_pool.slot_of(s.seq_id) for s in self.sched.running]
        assert len(set(slots)) == len(slots)
        assert all(s.status is SequenceStatus.RUNNING for s in self.sched.running)


TestSimulatedHybridWorker = SimulatedHybridWorker.TestCase
TestSimulatedHybridWorker.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
