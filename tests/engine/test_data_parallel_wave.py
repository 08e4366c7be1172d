"""The replicas' lockstep rule (engine/data_parallel_wave.py) and their summed stats, pure Python:
the race the wave number exists for, played message by message."""

from __future__ import annotations

from tengyun.engine.data_parallel_stats import combine
from tengyun.engine.data_parallel_wave import DataParallelWave, keep_stepping
from tengyun.engine.llm_engine import EngineStats


def test_a_request_read_after_the_others_saw_its_wave_keeps_every_replica_stepping():
    """Request 1 reaches replica 0 just after it read its messages, while replica 1 has read
    StartWave(1): counting requests alone both vote 0 and stop, and replica 0 would step alone."""
    r0, r1 = DataParallelWave(), DataParallelWave()
    r1.start(1)  # replica 0's copy of StartWave(1) and the request are still in its pipe
    votes = [r0.vote(unfinished=0), r1.vote(unfinished=0)]
    assert not keep_stepping([(0, 0), (0, 0)])  # what the requests alone would say
    assert keep_stepping(votes)
    for wave in (r0, r1):
        wave.voted(keep_stepping(votes))
    r0.start(1)  # next step: replica 0 reads the request and its StartWave
    votes = [r0.vote(unfinished=1), r1.vote(unfinished=0)]
    assert keep_stepping(votes)
    votes = [r0.vote(unfinished=0), r1.vote(unfinished=0)]  # the request finished
    assert not keep_stepping(votes)
    for wave in (r0, r1):
        wave.voted(keep_stepping(votes))
    assert not r0.active and not r1.active  # both wait for messages now, at the same step


def test_start_wave_keeps_the_newest_and_makes_the_replica_step():
    wave = DataParallelWave()
    wave.start(5)
    wave.start(3)
    assert wave.active and wave.vote(2) == (2, 5)


def _stats(running, waiting, usage, blocks, generated) -> EngineStats:
    return EngineStats(num_running=running, num_waiting=waiting, kv_cache_usage=usage, prefix_cache_queries=0,
                       prefix_cache_hits=0, num_preemptions=0, prompt_tokens=0, generation_tokens=generated,
                       num_kv_blocks=blocks)


def test_replica_stats_sum_with_kv_usage_weighted_by_blocks():
    total = combine([_stats(3, 1, 0.5, 100, 40), _stats(1, 0, 0.1, 300, 12)], engine_index=1)
    assert (total.num_running, total.num_waiting, total.generation_tokens, total.num_kv_blocks) == (4, 1, 52, 400)
    assert total.kv_cache_usage == (50 + 30) / 400
    assert total.engine_index == 1 and [r.num_running for r in total.replicas] == [3, 1]
