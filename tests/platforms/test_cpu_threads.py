"""The CPU model thread's OpenMP thread count: ThreadTuner fed synthetic step times (no timing
here), the OMP_NUM_THREADS / multi-rank overrides and their log lines, and the count applied
in the thread that runs the step."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import pytest
import torch

from tengyun import LLM, SamplingParams
from tengyun.platforms.cpu.runtime.threads import (
    MAX_RESTARTS, StepThreads, ThreadTuner, model_step_threads, release_openmp_pool, time_thread_counts,
)


def run_steps(tuner: ThreadTuner, ms_per_token: dict[int, float], steps: int, tokens: int = 64) -> list[int]:
    """Run ``steps`` steps whose time per token depends only on the thread count -> the counts used."""
    used = []
    for _ in range(steps):
        n = tuner.next_threads(tokens)
        used.append(n)
        tuner.record(n, ms_per_token[n] * tokens / 1e3, tokens)
    return used


def test_a_busy_core_moves_the_tuner_to_the_faster_thread_count():
    tuner = ThreadTuner(2, probe_pairs=2, warmup_steps=2)
    used = run_steps(tuner, {2: 3.0, 1: 1.2}, steps=6)
    assert used == [2, 2, 1, 2, 1, 2]  # warm-up, then the probe alternates 1 and 2
    assert tuner.threads == 1
    assert run_steps(tuner, {2: 3.0, 1: 1.2}, steps=20) == [1] * 20


def test_a_quiet_machine_keeps_all_threads_and_probes_ever_less_often():
    tuner = ThreadTuner(2, probe_pairs=2, warmup_steps=0, first_interval=8, max_interval=32)
    used = run_steps(tuner, {2: 1.0, 1: 1.6}, steps=4 + 16 + 4 + 32 + 4 + 32 + 4)
    assert tuner.threads == 2
    probes = [i for i, n in enumerate(used) if n == 1]
    # probes at 0, after 16 (8 doubled), after 32, then 32 again (the cap): [1, 2, 1, 2] each
    assert probes == [0, 2, 20, 22, 56, 58, 92, 94]


def test_the_tuner_goes_back_to_all_threads_when_the_core_frees():
    tuner = ThreadTuner(2, probe_pairs=2, warmup_steps=0, first_interval=8)
    run_steps(tuner, {2: 3.0, 1: 1.2}, steps=4)
    assert tuner.threads == 1
    run_steps(tuner, {2: 1.0, 1: 1.6}, steps=8 + 4)
    assert tuner.threads == 2


def test_a_count_within_the_margin_does_not_replace_the_current_one():
    tuner = ThreadTuner(2, warmup_steps=0, margin=0.05, fewer_margin=0.05)
    run_steps(tuner, {2: 1.0, 1: 0.97}, steps=4)
    assert tuner.threads == 2
    run_steps(tuner, {2: 1.0, 1: 0.9}, steps=64 + 4)
    assert tuner.threads == 1
    run_steps(tuner, {2: 0.97, 1: 1.0}, steps=32 + 4)
    assert tuner.threads == 1
    run_steps(tuner, {2: 0.9, 1: 1.0}, steps=64 + 4)
    assert tuner.threads == 2


def test_fewer_threads_must_win_by_more_since_prefill_runs_at_the_count_too():
    """A decode step 10% faster on 1 thread (a small model at batch 1 on quiet cores) keeps 2: the
    prefill chunks, never probed, run at the chosen count; a busy core's 1.5x does move it."""
    tuner = ThreadTuner(2, warmup_steps=0)
    run_steps(tuner, {2: 1.1, 1: 1.0}, steps=4 + 64 + 4 + 128 + 4)
    assert tuner.threads == 2
    run_steps(tuner, {2: 1.5, 1: 1.0}, steps=256 + 4)
    assert tuner.threads == 1


def test_many_cores_probe_one_count_either_side():
    tuner = ThreadTuner(8, probe_pairs=1, warmup_steps=0, first_interval=1, fewer_margin=0.05)
    ms_per_token = {n: 1.0 + abs(n - 5) for n in range(1, 9)}  # 5 threads is fastest
    assert run_steps(tuner, ms_per_token, steps=2) == [7, 8]  # 9 is beyond the cores
    assert tuner.threads == 7
    assert run_steps(tuner, ms_per_token, steps=3) == [7, 6, 8]
    run_steps(tuner, ms_per_token, steps=40)
    assert tuner.threads == 5


def test_prefill_chunks_never_run_at_a_trial_count():
    tuner = ThreadTuner(2, warmup_steps=0, max_probe_tokens=256)
    assert tuner.next_threads(2048) == 2  # a probe is due, but not on a 2048-token step
    tuner.record(2, 1.3, 2048)
    assert tuner.next_threads(64) == 1  # the first decode step starts it


def test_a_change_of_step_size_restarts_the_probe_and_repeated_changes_skip_it():
    ms = {2: 3.0, 1: 1.2}
    tuner = ThreadTuner(2, probe_pairs=2, warmup_steps=0, first_interval=8)
    run_steps(tuner, ms, steps=3, tokens=64)  # [1, 2, 1] of the probe's [1, 2, 1, 2]
    assert run_steps(tuner, ms, steps=4, tokens=16) == [1, 2, 1, 2]  # the batch shrank: start over
    assert tuner.threads == 1
    tuner = ThreadTuner(2, warmup_steps=0, first_interval=8)
    for size in range(MAX_RESTARTS):  # every step a different size: the probe is skipped
        assert tuner.next_threads(8 * 2**size) == 1
        tuner.record(1, 1e-3, 8 * 2**size)
    assert run_steps(tuner, ms, steps=8, tokens=8) == [2] * 8
    assert tuner.threads == 2


def test_a_sudden_slowdown_brings_the_next_probe_forward():
    tuner = ThreadTuner(2, probe_pairs=2, warmup_steps=0, first_interval=512)
    run_steps(tuner, {2: 1.0, 1: 1.6}, steps=4)  # quiet: keep 2, next probe in 1024 steps
    assert run_steps(tuner, {2: 1.0, 1: 1.6}, steps=50) == [2] * 50
    used = run_steps(tuner, {2: 4.0, 1: 1.6}, steps=3 + 4)  # a spinner arrives
    assert used == [2, 2, 2, 1, 2, 1, 2] and tuner.threads == 1


def test_omp_num_threads_fixes_the_count_and_says_so(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="tengyun.platforms.cpu.runtime.threads")
    monkeypatch.setenv("TENGYUN_CPU_OMP_THREADS_BIND", "nobind")  # bound threads: test_cpu_thread_binding.py
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert model_step_threads(world_size=1, threads=2) is None
    assert "OpenMP: 2 threads, fixed: OMP_NUM_THREADS=2 fixes the count" in caplog.text
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert model_step_threads(world_size=2, threads=2) is None
    assert "fixed: 2 ranks" in caplog.text
    assert model_step_threads(world_size=1, threads=1) is None
    assert "OpenMP: 1 thread, fixed: one core available" in caplog.text
    step_threads = model_step_threads(world_size=1, threads=2)
    assert isinstance(step_threads, StepThreads) and step_threads.tuner.max_threads == 2
    assert "OpenMP: 2 threads (the cores torch found), tuned at run time" in caplog.text


def test_a_start_up_check_chooses_the_count_the_first_steps_run_with(caplog):
    """The first step is often the largest prefill chunk, which probes never touch."""
    caplog.set_level(logging.INFO, logger="tengyun.platforms.cpu.runtime.threads")
    checked = []

    def busy_core(counts, set_threads):
        checked.append((counts, threading.get_ident()))
        return {1: 0.010, 2: 0.050}

    tuner = ThreadTuner(2, warmup_steps=2)
    step_threads = StepThreads(tuner, lambda: 2, lambda n: None, time_counts=busy_core)
    for _ in range(2):
        with step_threads(2048):
            pass
    # before the first step, in its thread; twice, since it moves to fewer threads
    assert checked == [([1, 2], threading.get_ident())] * 2
    assert tuner.threads == 1
    assert "OpenMP threads 2 -> 1: 1 thread 10.00 ms, 2 threads 50.00 ms, a start-up check" in caplog.text
    tuner = ThreadTuner(2, first_interval=8)
    tuner.start_from({1: 0.020, 2: 0.011})  # kept: the first probe comes after twice the interval
    assert tuner.threads == 2
    assert run_steps(tuner, {2: 1.0, 1: 1.6}, steps=17) == [2] * 16 + [1]


def test_the_start_up_check_times_again_before_moving_to_fewer_threads_and_keeps_the_faster_times():
    """A burst of load during the first timing (the server's API process at its warm-up request)
    must not start the engine on fewer threads: each count keeps the faster of two timings."""
    def timings(*results):
        calls = []

        def time_counts(counts, set_threads):
            calls.append(counts)
            return results[len(calls) - 1]
        return calls, time_counts

    for results, threads, times in [
        (({1: 0.010, 2: 0.050}, {1: 0.011, 2: 0.006}), 2, 2),  # a burst, gone 50 ms later: stays
        (({1: 0.010, 2: 0.050}, {1: 0.009, 2: 0.040}), 1, 2),  # still busy: moves
        (({1: 0.010, 2: 0.006},), 2, 1),  # nothing to confirm: timed once
    ]:
        calls, time_counts = timings(*results)
        tuner = ThreadTuner(2)
        with StepThreads(tuner, lambda: 2, lambda n: None, time_counts=time_counts)(2048):
            pass
        assert (tuner.threads, len(calls)) == (threads, times)


def test_a_start_up_check_that_chose_fewer_threads_is_taken_again_until_the_cores_are_back():
    """A burst of load at start-up (the server's API process loading its tokenizer just before the
    warm-up request) must not hold the engine on fewer threads until its first probe, 32 steps on:
    the check is taken again 0.5 s later, then after 1, 2, 4 and 8 s, while it holds fewer threads."""
    now = [0.0]
    busy, quiet = {1: 0.010, 2: 0.050}, {1: 0.010, 2: 0.006}

    def run(results_after: Callable[[float], dict[int, float]], until: float) -> tuple[ThreadTuner, list[float]]:
        now[0], checked = 0.0, []

        def time_counts(counts, set_threads):
            checked.append(now[0])
            return results_after(now[0])
        tuner = ThreadTuner(2)
        step_threads = StepThreads(tuner, lambda: 2, lambda n: None, time_counts=time_counts, clock=lambda: now[0])
        while now[0] < until:
            with step_threads(2048):
                pass
            now[0] += 0.1
        return tuner, checked

    # busy for the first 0.3 s: 1 thread at start-up (confirmed), 2 again at the first re-check
    tuner, checked = run(lambda t: busy if t < 0.3 else quiet, until=30)
    assert tuner.threads == 2
    assert checked == [0.0, 0.0, pytest.approx(0.5)]
    # busy all along: taken again 5 times, 0.5 s and then twice as long each time apart, then left to the probes
    tuner, checked = run(lambda t: busy, until=30)
    assert tuner.threads == 1
    # (at the first step at or after each due time, steps 0.1 s apart)
    gaps = [b - a for a, b in zip(checked[1:], checked[2:])]
    assert checked[:2] == [0.0, 0.0] and gaps == [pytest.approx(g, abs=0.15) for g in (0.5, 1, 2, 4, 8)]
    # quiet at start-up: one timing, no re-check
    tuner, checked = run(lambda t: quiet, until=30)
    assert (tuner.threads, checked) == (2, [0.0])


def test_the_start_up_check_times_every_count_it_is_given():
    original = torch.get_num_threads()
    try:
        seconds = time_thread_counts([1, 2], torch.set_num_threads, rounds=1)
    finally:
        torch.set_num_threads(original)
    assert sorted(seconds) == [1, 2] and all(s > 0 for s in seconds.values())


def test_the_count_applies_in_the_thread_that_runs_the_step():
    """torch.set_num_threads acts on the calling thread's OpenMP pool: the engine thread of
    `tengyun serve` must set its own, not inherit what the loading thread chose."""
    class RecordingTuner(ThreadTuner):
        def record(self, threads: int, seconds: float, tokens: int) -> None:
            recorded.append((threads, tokens))
            super().record(threads, seconds, tokens)

    original, recorded, seen = torch.get_num_threads(), [], []
    tuner = RecordingTuner(2)  # the start-up check below finds 1 thread faster
    step_threads = StepThreads(tuner, torch.get_num_threads, torch.set_num_threads,
                               time_counts=lambda counts, set_threads: {1: 0.01, 2: 0.05})

    def engine_thread():
        with step_threads(8):
            seen.append(torch.get_num_threads())
            torch.ones(64, 64) @ torch.ones(64, 64)

    try:
        worker = threading.Thread(target=engine_thread)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(original)
    assert seen == [1] and recorded == [(1, 8)]


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="an OpenMP pool needs 2 threads")
def test_releasing_the_openmp_pool_ends_its_threads():
    """The building thread's pool must go, or libgomp throttles the stepping thread's (two pools
    hold more threads than there are cores)."""
    def threads_in_process() -> int:
        return len(os.listdir("/proc/self/task"))

    def run_in_fresh_thread(fn):
        result = []
        worker = threading.Thread(target=lambda: result.append(fn()))
        worker.start()
        worker.join()
        return result[0]

    def build_then_release() -> tuple[int, int, bool]:
        torch.set_num_threads(2)
        torch.ones(512, 512) @ torch.ones(512, 512)  # this thread's pool: one more thread
        with_pool = threads_in_process()
        released = release_openmp_pool()
        deadline = time.monotonic() + 5
        while threads_in_process() >= with_pool and time.monotonic() < deadline:
            time.sleep(0.01)  # the pool's threads exit on their own
        return with_pool, threads_in_process(), released

    with_pool, after, released = run_in_fresh_thread(build_then_release)
    assert released and after == with_pool - 1


def test_the_engine_steps_through_the_tuner_unless_omp_num_threads_is_set(tiny_checkpoints, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="tengyun.platforms.cpu.runtime.threads")
    folder = str(tiny_checkpoints["llama"])
    args = dict(block_size=8, max_model_len=64, max_num_seqs=4, kv_cache_memory="1MiB")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    llm = LLM(folder, **args)
    if torch.get_num_threads() > 1:
        llm.generate(["The quick brown fox"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        decisions = [r.message for r in caplog.records if r.message.startswith("OpenMP threads ")]
        assert len(decisions) == 1 and "a start-up check" in decisions[0]  # probes come 32+ steps later
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("TENGYUN_CPU_OMP_THREADS_BIND", "nobind")
    assert LLM(folder, **args).llm_engine.executor.step_threads is None
