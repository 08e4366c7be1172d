"""Batches in flight (pipeline parallel) at the engine level, against a fake pipeline: a
sequence is in at most one in-flight batch, its tokens arrive when its batch comes back, and
the tokens equal those of one batch at a time (preemption, abort and prefix hits included)."""

from __future__ import annotations

import random
from collections import deque

import pytest

from tengyun.config import EngineConfig
from tengyun.engine.llm_engine import LLMEngine
from tengyun.engine.messages import ModelRunnerOutput, SchedulerOutput
from tengyun.sampling_params import SamplingParams
from tengyun.tokenizer import get_tokenizer


class FakePipeline:
    """A P-stage pipeline that keeps its own token state as the sampling rank does: the next
    token is a function of the sequence's tokens, so batching cannot change it."""

    num_state_slots = num_state_snapshots = 0

    def __init__(self, num_blocks: int, vocab_size: int):
        self.num_blocks, self.vocab_size = num_blocks, vocab_size
        self.tokens: dict[int, list[int]] = {}
        self.queue: deque[SchedulerOutput] = deque()
        self.max_in_flight = 0

    def submit(self, sched: SchedulerOutput) -> None:
        in_flight = {seq_id for s in self.queue for seq_id in s.num_scheduled_tokens}
        assert not in_flight & set(sched.num_scheduled_tokens), "a sequence in two batches in flight"
        self.queue.append(sched)
        self.max_in_flight = max(self.max_in_flight, len(self.queue))

    def next_result(self) -> ModelRunnerOutput:
        return self.execute_model(self.queue.popleft())

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for seq_id in sched.freed_seq_ids:
            self.tokens.pop(seq_id, None)
        computed = {new.seq_id: new.num_computed_tokens for new in sched.new_seqs}
        computed |= {cached.seq_id: cached.num_computed_tokens for cached in sched.cached_seqs}
        for new in sched.new_seqs:
            self.tokens[new.seq_id] = list(new.token_ids)
        out = ModelRunnerOutput()
        for seq_id, n in sched.num_scheduled_tokens.items():
            tokens = self.tokens[seq_id]
            if computed[seq_id] + n == len(tokens):  # the chunk reaches the last known token
                token = (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + 7) % self.vocab_size
                tokens.append(token)
                out.sampled_token_ids[seq_id] = [token]
        return out


def _engine(folder, pp: int, **overrides) -> tuple[LLMEngine, FakePipeline]:
    args = dict(model=str(folder), dtype="float32", block_size=4, max_model_len=64, max_num_batched_tokens=24,
                max_num_seqs=8, pipeline_parallel_size=pp, distributed_executor_backend="mp") | overrides
    config = EngineConfig(**args)
    config.finalize()
    executor = FakePipeline(args.get("num_gpu_blocks_override") or 64, config.model_spec.vocab_size)
    return LLMEngine(config, get_tokenizer(config), executor, eos_token_ids=set()), executor


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(1, 300) for _ in range(12)]
    return [[rng.randrange(1, 300) for _ in range(n)] for n in (3, 30, 9, 17)] + \
        [shared + [rng.randrange(1, 300) for _ in range(n)] for n in (2, 5, 7)]


def _run(engine: LLMEngine, abort_after: int | None = None) -> dict[str, tuple[list[int], str]]:
    """request id -> (tokens, finish reason); from step ``abort_after`` on, abort the first request in flight."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(_prompts()):
        engine.add_request(str(i), prompt, params)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = (output.outputs[0].token_ids, output.outputs[0].finish_reason)
        steps += 1
        if abort_after is not None and steps >= abort_after and engine._in_flight:
            abort_after = None
            in_flight = engine._in_flight[0].num_scheduled_tokens
            engine.abort_request(engine.seqs[next(iter(in_flight))].request_id)
    return done


@pytest.mark.parametrize("blocks", [64, 14])  # 14: preemption must happen
def test_two_batches_in_flight_give_one_batch_at_a_times_tokens(tiny_checkpoints, blocks):
    folder = tiny_checkpoints["llama"]
    reference, _ = _engine(folder, pp=1, num_gpu_blocks_override=blocks)
    engine, pipeline = _engine(folder, pp=2, num_gpu_blocks_override=blocks)
    assert engine.batches_in_flight == 2
    assert _run(engine) == _run(reference)
    assert pipeline.max_in_flight == 2
    stats = engine.get_stats()
    assert stats.prefix_cache_hits > 0
    assert (stats.num_preemptions > 0) == (blocks == 14)
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


def test_abort_of_a_sequence_in_flight_drops_its_late_tokens(tiny_checkpoints):
    folder = tiny_checkpoints["llama"]
    reference = _run(_engine(folder, pp=1)[0])
    engine, _ = _engine(folder, pp=2)
    got = _run(engine, abort_after=3)
    aborted = [k for k, (_, reason) in got.items() if reason == "abort"]
    assert len(aborted) == 1
    assert {k: v for k, v in got.items() if k not in aborted} == \
        {k: v for k, v in reference.items() if k not in aborted}
    assert engine.get_stats().kv_cache_usage == 0.0 and not engine.seqs


def test_batches_split_the_sequences_evenly():
    """64 decoding sequences, 2 in flight -> 32 per batch (not 64 then none)."""
    from tengyun.engine.scheduler import Scheduler
    from tengyun.engine.sequence import Sequence

    config = EngineConfig(block_size=4, max_model_len=64, max_num_seqs=64, max_num_batched_tokens=4096)
    scheduler = Scheduler(config, num_blocks=1024, batches_in_flight=2)
    seqs = {i: Sequence(i, str(i), 0, [1, 2, 3], SamplingParams(), arrival_order=i) for i in range(64)}
    for seq in seqs.values():
        scheduler.add(seq)
    first, second = scheduler.schedule(), scheduler.schedule()
    assert (len(first.num_scheduled_tokens), len(second.num_scheduled_tokens)) == (32, 32)
    assert scheduler.schedule().is_empty  # every sequence is in flight
    scheduler.advance(first, seqs)
    assert set(scheduler.schedule().num_scheduled_tokens) == set(first.num_scheduled_tokens)


def test_overlap_switch_and_unsafe_features_fall_back_to_one_batch(tiny_checkpoints):
    folder = tiny_checkpoints["llama"]
    assert _engine(folder, pp=2, disable_pipeline_overlap=True)[0].batches_in_flight == 1
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert _engine(folder, pp=2, speculative_config=spec)[0].batches_in_flight == 1
