"""Round-robin admission between API requests: a request with many sequences (n copies, several
prompts) cannot hold back the requests behind it."""

from __future__ import annotations

from types import SimpleNamespace

from tengyun.engine.scheduler import Scheduler
from tengyun.engine.sequence import Sequence
from tengyun.sampling_params import SamplingParams

CONFIG = SimpleNamespace(max_num_seqs=2, max_num_batched_tokens=64, enable_chunked_prefill=True,
                         block_size=4, enable_prefix_caching=False)


def _seqs(first_id: int, request_id: str, turns: range) -> list[Sequence]:
    return [Sequence(first_id + k, request_id, k, [1, 2, 3], SamplingParams(), arrival_order=first_id + k,
                     turn=turn) for k, turn in enumerate(turns)]


def test_later_request_runs_beside_a_many_sequence_request():
    scheduler = Scheduler(CONFIG, num_blocks=32)
    big, small = _seqs(0, "big", range(8)), _seqs(8, "small", range(1))
    for seq in big + small:
        scheduler.add(seq)
    assert [s.request_id + str(s.turn) for s in scheduler.waiting][:3] == ["big0", "small0", "big1"]
    out = scheduler.schedule()
    assert [data.seq_id for data in out.new_seqs] == [0, 8]  # big's first and small's only


def test_preempted_sequences_stay_ahead_of_new_turns():
    scheduler = Scheduler(CONFIG, num_blocks=32)
    first, = _seqs(0, "a", range(1))
    scheduler.add(first)
    scheduler.schedule()
    scheduler._preempt(first)
    newcomer, = _seqs(1, "b", range(1))
    scheduler.add(newcomer)
    assert list(scheduler.waiting) == [first, newcomer]


def test_turns_keep_arrival_order_within_a_turn():
    scheduler = Scheduler(CONFIG, num_blocks=32)
    a, b, c = _seqs(0, "a", range(2)), _seqs(2, "b", range(2)), _seqs(4, "c", range(1))
    for seq in a + b + c:
        scheduler.add(seq)
    assert [s.seq_id for s in scheduler.waiting] == [0, 2, 4, 1, 3]
