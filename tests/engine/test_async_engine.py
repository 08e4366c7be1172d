"""AsyncLLMEngine over a fake LLMEngine: streaming order, per-caller errors, abort on
cancellation, death of the loop thread, and the no-torch boundary of engine/."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from tengyun.engine.async_engine import AsyncLLMEngine, EngineDeadError
from tengyun.engine.llm_engine import EngineStats
from tengyun.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestProgress
from tengyun.sampling_params import SamplingParams


LONG = 10**6  # steps a "long" request would take: it is always aborted or failed first


class FakeLLMEngine:
    """One character per step per request ("a", "ab", ...); a request stops at max_tokens."""

    def __init__(self):
        self.config = SimpleNamespace(max_model_len=64, model_spec=SimpleNamespace(vocab_size=100),
                                      served_model_name="fake")
        self.requests: dict[str, tuple[list[int], SamplingParams, int]] = {}
        self.pending: list[RequestOutput] = []
        self.aborted: list[str] = []
        self.fail_with: BaseException | None = None
        self.health_error: BaseException | None = None  # what check_health raises (a dead worker)
        self.shut_down = False
        self.steps = 0
        self.memory_reports: list[dict] = []  # LLMEngine's: each rank's memory once loaded

    def check_health(self):
        if self.health_error is not None:
            raise self.health_error

    def shutdown(self):
        self.shut_down = True

    def add_request(self, request_id, prompt, params, arrival_time=None, first_turn=0, lora_request=None):
        if not prompt:
            raise ValueError("prompt must not be empty.")
        self.requests[request_id] = (list(prompt), params, 0)

    def abort_request(self, request_ids):
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            if self.requests.pop(request_id, None) is not None:
                self.aborted.append(request_id)
                self.pending.append(self._output(request_id, [], 0, "abort"))

    def has_unfinished_requests(self):
        return bool(self.requests or self.pending)

    def step(self):
        time.sleep(0.001)  # a model step takes time; it also lets the event loop run
        self.steps += 1
        if self.fail_with is not None:
            raise self.fail_with
        outputs, self.pending = self.pending, []
        for request_id, (prompt, params, done) in list(self.requests.items()):
            done += 1
            finished = done >= params.max_tokens
            outputs.append(self._output(request_id, prompt, done, "length" if finished else None))
            if finished:
                del self.requests[request_id]
            else:
                self.requests[request_id] = (prompt, params, done)
        return outputs

    def step_with_progress(self):
        outputs = self.step()
        return outputs, [RequestProgress(o.request_id, len(o.prompt_token_ids), [len(o.outputs[0].token_ids)],
                                         [o.outputs[0].finish_reason], o.finished, RequestMetrics(0.0))
                         for o in outputs]

    @staticmethod
    def _output(request_id, prompt, done, reason):
        text = "abcdefghijklmnopqrstuvwxyz"[:done]
        completion = CompletionOutput(0, text, list(range(done)), finish_reason=reason)
        return RequestOutput(request_id, None, prompt, [completion], finished=reason is not None)

    def get_stats(self):
        return EngineStats(num_running=len(self.requests), num_waiting=0, kv_cache_usage=0.0,
                           prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                           prompt_tokens=0, generation_tokens=self.steps)


async def _wait_until(predicate, timeout=30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def _run(coro_fn):
    """Run an async test body with a started engine; shut the thread down afterwards."""
    fake = FakeLLMEngine()
    engine = AsyncLLMEngine(fake)

    async def main():
        engine.start()
        try:
            return await coro_fn(engine, fake)
        finally:
            engine.shutdown()

    return asyncio.run(main())


def test_generate_streams_every_step_then_the_finished_output():
    async def body(engine, fake):
        texts = [out.outputs[0].text async for out in engine.generate("r", [1, 2], SamplingParams(max_tokens=4))]
        assert texts == ["a", "ab", "abc", "abcd"]
        assert engine.num_in_flight == 0

    _run(body)


def test_concurrent_requests_each_get_their_own_outputs():
    async def body(engine, fake):
        async def collect(request_id, n):
            return [o.outputs[0].text async for o in engine.generate(request_id, [1], SamplingParams(max_tokens=n))]

        results = await asyncio.gather(*(collect(f"r{i}", i + 1) for i in range(8)))
        assert results == [["abcdefgh"[:k] for k in range(1, i + 2)] for i in range(8)]

    _run(body)


def test_add_request_error_reaches_only_its_caller():
    async def body(engine, fake):
        good = engine.generate("good", [1], SamplingParams(max_tokens=6))
        first = await good.__anext__()
        with pytest.raises(ValueError, match="prompt must not be empty"):
            async for _ in engine.generate("bad", [], SamplingParams(max_tokens=2)):
                pass
        rest = [o.outputs[0].text async for o in good]
        assert [first.outputs[0].text] + rest == ["a", "ab", "abc", "abcd", "abcde", "abcdef"]
        assert engine.is_healthy and fake.aborted == []

    _run(body)


def test_cancelled_consumer_aborts_its_request():
    async def body(engine, fake):
        async def consume():
            async for _ in engine.generate("gone", [1], SamplingParams(max_tokens=LONG)):
                pass

        task = asyncio.create_task(consume())
        await _wait_until(lambda: fake.steps >= 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_until(lambda: fake.aborted == ["gone"] and not fake.has_unfinished_requests())
        assert engine.num_in_flight == 0 and engine.is_healthy

    _run(body)


def test_closing_the_stream_early_aborts_the_request():
    async def body(engine, fake):
        stream = engine.generate("closed", [1], SamplingParams(max_tokens=LONG))
        await stream.__anext__()
        await stream.aclose()
        await _wait_until(lambda: fake.aborted == ["closed"])

    _run(body)


def test_dead_loop_fails_in_flight_and_new_requests_and_reports_unhealthy():
    async def body(engine, fake):
        stream = engine.generate("victim", [1], SamplingParams(max_tokens=LONG))
        await stream.__anext__()
        fake.fail_with = RuntimeError("device lost")
        with pytest.raises(EngineDeadError, match="device lost"):
            async for _ in stream:
                pass
        assert not engine.is_healthy and engine.errored
        with pytest.raises(EngineDeadError):
            await engine.generate("late", [1], SamplingParams(max_tokens=2)).__anext__()

    _run(body)


def test_step_listeners_see_outputs_and_stats_and_a_failing_listener_is_contained():
    async def body(engine, fake):
        seen = []
        engine.add_step_listener(lambda outputs, stats: 1 / 0)
        engine.add_step_listener(lambda outputs, stats: seen.append(([o.request_id for o in outputs], stats)))
        async for _ in engine.generate("r", [1], SamplingParams(max_tokens=3)):
            pass
        assert [ids for ids, _ in seen] == [["r"], ["r"], ["r"]]
        assert engine.latest_stats is seen[-1][1] and engine.is_healthy

    _run(body)


def test_engine_package_does_not_import_torch():
    code = ("import sys, tengyun.engine.async_engine, tengyun.engine.llm_engine; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
            "sys.exit(f'engine/ imported {bad[:3]}' if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_dead_worker_while_idle_kills_the_loop_naming_the_rank():
    async def body(engine, fake):
        fake.health_error = RuntimeError("worker rank 1 (pid 42) exited with code -9")
        await _wait_until(lambda: engine.errored, timeout=5.0)
        assert "worker rank 1" in engine.dead_error
        assert fake.shut_down
        with pytest.raises(EngineDeadError, match="rank 1"):
            async for _ in engine.generate("late", [1], SamplingParams(max_tokens=2)):
                pass

    _run(body)
