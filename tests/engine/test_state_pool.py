"""The recurrent-state slot pool of hybrid models: the real Scheduler never leaks a slot over
random admit / preempt / finish / abort, never admits without a free slot, and frees all at the end."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tengyun.engine.scheduler import Scheduler
from tengyun.engine.sequence import Sequence, SequenceStatus
from tengyun.engine.state_pool import StatePool
from tengyun.sampling_params import SamplingParams

SLOTS = 3


def _config(max_num_seqs: int = 5, budget: int = 16):
    return SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=True,
                           block_size=4, enable_prefix_caching=False)


def test_pool_hands_out_lowest_free_slot_and_reuses_freed_ones():
    pool = StatePool(3)
    assert [pool.allocate(i) for i in (10, 11, 12)] == [0, 1, 2]
    assert not pool.can_allocate()
    pool.free(11)
    pool.free(11)  # twice: no-op
    assert pool.num_free == 1 and pool.allocate(13) == 1


def test_scheduler_admits_no_more_sequences_than_state_slots():
    sched = Scheduler(_config(max_num_seqs=5, budget=64), num_blocks=64, num_state_slots=2)
    for i in range(4):
        sched.add(Sequence(i, str(i), 0, [1, 2, 3], SamplingParams(), arrival_order=i))
    out = sched.schedule()
    assert [(s.seq_id, s.state_slot) for s in out.new_seqs] == [(0, 0), (1, 1)]
    assert len(sched.waiting) == 2


class SchedulerStateMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        # 10 blocks of 4 tokens: preemption happens once a few sequences grow.
        self.sched = Scheduler(_config(), num_blocks=10, num_state_slots=SLOTS)
        self.seqs: dict[int, Sequence] = {}
        self.next_id = 0

    @rule(length=st.integers(1, 14))
    def add(self, length):
        seq = Sequence(self.next_id, str(self.next_id), 0, list(range(1, length + 1)), SamplingParams(),
                       arrival_order=self.next_id)
        self.seqs[seq.seq_id] = seq
        self.sched.add(seq)
        self.next_id += 1

    @rule()
    def step(self):
        out = self.sched.schedule()
        for new in out.new_seqs:
            assert new.state_slot == self.sched.state_pool.slot_of(new.seq_id)
        self.sched.advance(out, self.seqs)
        for seq_id in out.num_scheduled_tokens:  # every sequence that reached its end samples one token
            seq = self.seqs[seq_id]
            if seq.num_uncomputed_tokens == 0:
                seq.append_token(7)

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def finish_running(self, data):
        self.sched.finish(data.draw(st.sampled_from(self.sched.running)))

    @precondition(lambda self: self.sched.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data):
        self.sched.finish(data.draw(st.sampled_from(list(self.sched.waiting))))

    @invariant()
    def running_sequences_own_distinct_slots_and_nobody_else_does(self):
        pool = self.sched.state_pool
        slots = [pool.slot_of(s.seq_id) for s in self.sched.running]
        assert None not in slots and len(set(slots)) == len(slots)
        assert pool.num_free == SLOTS - len(self.sched.running)
        for seq in self.seqs.values():
            if seq.status is not SequenceStatus.RUNNING:
                assert pool.slot_of(seq.seq_id) is None

    def teardown(self):
        for seq in list(self.sched.running) + list(self.sched.waiting):
            self.sched.finish(seq)
        assert self.sched.state_pool.num_free == SLOTS


TestSchedulerStateMachine = SchedulerStateMachine.TestCase
TestSchedulerStateMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
