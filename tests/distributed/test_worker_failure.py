"""A worker process that dies or hangs makes the engine fail fast, naming the rank: no hang."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tengyun import LLM, SamplingParams
from tengyun.executor.multiproc_executor import WorkerDiedError

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _llm(folder, **args) -> LLM:
    return LLM(str(folder), block_size=8, max_model_len=64, kv_cache_memory="1MiB", tensor_parallel_size=2, **args)


def test_killed_worker_fails_the_next_step_naming_its_rank(tiny_checkpoints):
    llm = _llm(tiny_checkpoints["llama"])
    executor = llm.llm_engine.executor
    try:
        assert llm.generate([[1, 2, 3]], PARAMS)[0].outputs[0].token_ids  # the world works
        os.kill(executor.ranks[1].process.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
            llm.generate([[4, 5, 6]], PARAMS)
        assert time.monotonic() - started < 10
        with pytest.raises(WorkerDiedError, match="worker rank 1"):
            llm.llm_engine.check_health()
    finally:
        llm.llm_engine.shutdown()
    assert not any(r.process.is_alive() for r in executor.ranks)


def test_hung_worker_fails_within_distributed_timeout(tiny_checkpoints):
    llm = _llm(tiny_checkpoints["llama"], distributed_timeout=3)
    executor = llm.llm_engine.executor
    stuck = executor.ranks[1].process
    try:
        os.kill(stuck.pid, signal.SIGSTOP)  # alive but never answers: only the timeout can tell
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match="within --distributed-timeout 3 s"):
            llm.generate([[1, 2, 3]], PARAMS)
        assert 2.5 < time.monotonic() - started < 10
    finally:
        os.kill(stuck.pid, signal.SIGKILL)
        llm.llm_engine.shutdown()
