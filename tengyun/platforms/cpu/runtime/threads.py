"""The OpenMP thread count of the CPU model thread, chosen by timing.

torch's OpenMP threads (libgomp here) spin at the barrier that ends every parallel op, a few
hundred per step. When another process keeps one of the cores busy, the model thread that
shares that core runs only in the time slices the scheduler gives it, and every op waits for
it: SmolLM2 (16 x 128/32) made 65 output tok/s with a spinner on core 1 of this machine's 2
against 217 quiet, one thread 126 (benchmarks/README.md, "A busy core"). One thread fewer then
runs near its quiet speed, but on a quiet machine it is the slower choice. Which one wins is
measured, not guessed (a core busy with a niced process costs little, and /proc/stat cannot
tell):

- before the first step, ``time_thread_counts`` times a fixed matmul + element-wise workload
  at the current count and one fewer (~30 ms; a move to fewer is timed again 50 ms later), because
  the first steps are often the largest (prefill) and no probe runs those at a trial count; while
  that check holds fewer threads than the cores, it is taken again before the first step 0.5 s
  later, then after 1, 2, 4 and 8 s more (RECHECK_FIRST_S, RECHECKS): a burst of load at start-up
  (the server's API process loading its tokenizer just before the warm-up request) otherwise kept
  a served engine on one thread until its first probe, 32 steps on (~17 s of Qwen2.5-Coder-0.5B's
  first wave at concurrency 64 on 2 cores);
- then ``ThreadTuner`` times decode steps at the current count and its neighbours now and
  then, and keeps the fastest.

Probe schedule, 2 cores, at 2 threads: [1, 2, 1, 2] (alternating, so drift in the load hits
both counts); the faster count by seconds per scheduled token wins if it beats the current
one by ``margin``, a count below the current one by ``fewer_margin``: the count also runs the
prefill chunks, which no probe times and which on quiet cores run about twice as fast on 2
threads as on 1, while a small decode step can run a little faster on fewer threads there
(SmolLM2 at batch 1, AMD EPYC VM, 2026-12-06: 1 thread 10.0-11.6 ms a token, 2 threads
11.0-12.7; after a move to 1 thread the server prefilled a 128-token prompt in 124 ms, against
85-96 on 2). A busy core slows the higher count far more (2 threads 1.9x slower a token than 1,
benchmarks/README.md "A busy core"). Only steps of at most ``max_probe_tokens`` tokens take part
(decode steps: a prefill chunk at the slower count costs more than a probe wins back), and a
probe whose step sizes differ by more than ``size_tolerance`` restarts (batch sizes changed).
After a probe that keeps the count the next one waits twice as long (``first_interval`` ..
``max_interval`` steps); a change, or a step ``jump``x slower or faster per token than the count
measured at its last probe, brings the next probe forward.

OMP_NUM_THREADS set by the user fixes the count (no tuning); so does a multi-rank worker,
whose step times include waiting for the other ranks.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator

from tengyun.platforms.cpu.runtime.thread_binding import ThreadBinding, model_thread_binding, pool_released

logger = logging.getLogger(__name__)

USER_THREADS_ENV = "OMP_NUM_THREADS"
OPENMP_RUNTIMES = ("libgomp", "libiomp5", "libomp")  # file name prefixes
OMP_PAUSE_SOFT = 1
INFO_EVERY_S = 60.0  # changes log at INFO at most this often, the others at DEBUG
MAX_RESTARTS = 4  # probes cut short by a change of step size before one is skipped
CONFIRM_PAUSE_S = 0.05  # before the start-up check times the counts again (StepThreads._start_up_times)
RECHECK_FIRST_S = 0.5  # a start-up check that chose fewer threads is taken again this long after,
RECHECKS = 5  # then after twice as long each time, this many times in all (0.5 + 1 + 2 + 4 + 8 s)


class ThreadTuner:
    """Which thread count the next step runs with, from the times of the steps before (pure
    Python: fed (count, seconds, tokens) per step)."""

    def __init__(self, max_threads: int, probe_pairs: int = 2, warmup_steps: int = 2, first_interval: int = 32,
                 max_interval: int = 1024, margin: float = 0.05, size_tolerance: float = 1.25, jump: float = 1.5,
                 max_probe_tokens: int = 256, fewer_margin: float = 0.25):
        self.max_threads = max_threads
        self.threads = max_threads  # the chosen count, run outside probes
        self.probe_pairs, self.margin, self.size_tolerance, self.jump = probe_pairs, margin, size_tolerance, jump
        self.fewer_margin = fewer_margin  # what a count below the current one must win by
        self.first_interval, self.max_interval = first_interval, max_interval
        # Larger steps (prefill chunks) never run at a trial count: one of them at the slower
        # count would cost more than the probe can win back (1.3 s of SmolLM2 prefill at 2048 tokens).
        self.max_probe_tokens = max_probe_tokens
        self._interval = first_interval
        self._until_probe = warmup_steps  # steady steps left before the next probe (start_from resets it)
        self._schedule: list[int] = []  # thread counts of the probe steps still to run
        self._samples: dict[int, list[float]] = {}  # thread count -> seconds per token, this probe
        self._probe_tokens = 0  # the first probe step's size; the others must be within size_tolerance
        self._in_probe_step = False  # the step next_threads answered for is a probe step
        self._reference: tuple[int, float] | None = None  # (tokens, s/token) of self.threads at the last probe
        self._outliers = 0  # consecutive steady steps off the reference by more than ``jump``
        self._restarts = 0  # probes restarted in a row because step sizes changed
        self._last_info = -INFO_EVERY_S  # time.monotonic() of the last change logged at INFO

    def next_threads(self, tokens: int) -> int:
        """The thread count the next step, of ``tokens`` scheduled tokens, runs with (a probe starts
        when one is due and the step is small enough)."""
        self._in_probe_step = False
        if tokens > self.max_probe_tokens or self.max_threads == 1:
            return self.threads
        if self._schedule and self._samples and not _similar(tokens, self._probe_tokens, self.size_tolerance):
            self._restart_probe()  # the workload changed shape: start over from this step
        elif not self._schedule and self._until_probe <= 0:
            self._start_probe()
        self._in_probe_step = bool(self._schedule)
        return self._schedule[0] if self._schedule else self.threads

    def record(self, threads: int, seconds: float, tokens: int) -> None:
        """The step next_threads(tokens) answered ``threads`` for took ``seconds``."""
        per_token = seconds / max(tokens, 1)
        if not self._in_probe_step:
            self._until_probe -= 1
            self._watch_for_change(tokens, per_token)
            return
        if not self._samples:
            self._probe_tokens = tokens
        self._schedule.pop(0)
        self._samples.setdefault(threads, []).append(per_token)
        if not self._schedule:
            self._decide()

    def _start_probe(self) -> None:
        others = [n for n in self.candidates() if n != self.threads]
        self._schedule = [n for _ in range(self.probe_pairs) for n in (*others, self.threads)]
        self._samples = {}

    def _restart_probe(self) -> None:
        """Start the probe over; after ``MAX_RESTARTS`` in a row give up until the next interval."""
        self._restarts += 1
        if self._restarts < MAX_RESTARTS:
            self._start_probe()
        else:
            self._schedule, self._restarts, self._until_probe = [], 0, self._interval

    def candidates(self) -> list[int]:
        """The counts a probe compares: the current one and one either side, within 1..max_threads."""
        return [n for n in (self.threads - 1, self.threads, self.threads + 1) if 1 <= n <= self.max_threads]

    def start_from(self, seconds: dict[int, float], what: str = "a start-up check") -> None:
        """Choose the count before the first step from a timed workload (``seconds`` per count):
        the first steps are often the largest (prefill), which no probe may run at a trial count."""
        changed = self._choose(seconds, what)
        self._interval = self.first_interval if changed else self.first_interval * 2
        self._until_probe = self._interval

    def _decide(self) -> None:
        medians = {n: statistics.median(s) for n, s in self._samples.items()}
        changed = self._choose(medians, "per token")
        self._interval = self.first_interval if changed else min(self._interval * 2, self.max_interval)
        self._until_probe, self._restarts = self._interval, 0
        self._reference = (self._probe_tokens, medians[self.threads])
        self._outliers = 0

    def preferred(self, seconds: dict[int, float]) -> int:
        """The count these times (per count) would move to: the fastest, unless it beats the current
        one by less than margin (fewer_margin for a lower count); else the current one."""
        best, current = min(seconds, key=seconds.get), self.threads
        margin = self.fewer_margin if best < current else self.margin
        return current if seconds[best] >= seconds[current] * (1 - margin) else best

    def _choose(self, seconds: dict[int, float], what: str) -> bool:
        """Move to the preferred count -> moved."""
        best, current = self.preferred(seconds), self.threads
        if best == current:
            logger.debug("OpenMP threads stay %d: %s, %s", current, _describe(seconds), what)
            return False
        now = time.monotonic()
        level = logging.INFO if now - self._last_info >= INFO_EVERY_S else logging.DEBUG
        self._last_info = now if level == logging.INFO else self._last_info
        logger.log(level, "OpenMP threads %d -> %d: %s, %s (other processes busy on these cores?)",
                   current, best, _describe(seconds), what)
        self.threads = best
        return True

    def _watch_for_change(self, tokens: int, per_token: float) -> None:
        """Probe early after 3 like-sized steps in a row ``jump``x off the last probe's time."""
        if self._reference is None or not _similar(tokens, self._reference[0], self.size_tolerance):
            return  # prefill chunks, other batch sizes: not comparable
        ratio = per_token / self._reference[1]
        self._outliers = self._outliers + 1 if max(ratio, 1 / ratio) > self.jump else 0
        if self._outliers >= 3:
            self._until_probe, self._outliers = 0, 0


def _similar(a: int, b: int, tolerance: float) -> bool:
    return max(a, b) <= tolerance * max(min(a, b), 1)


def _threads(n: int) -> str:
    return f"{n} thread{'s' * (n != 1)}"


def _describe(medians: dict[int, float]) -> str:
    """{2: 0.0031, 1: 0.0012} -> "1 thread 1.20 ms, 2 threads 3.10 ms"."""
    return ", ".join(f"{_threads(n)} {medians[n] * 1e3:.2f} ms" for n in sorted(medians))


def user_thread_count() -> int | None:
    """OMP_NUM_THREADS as a count when the user set one ("4", or "4,2" for nested levels), else None."""
    first = os.environ.get(USER_THREADS_ENV, "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def time_thread_counts(counts: list[int], set_threads: Callable[[int], None], rounds: int = 3) -> dict[int, float]:
    """Median seconds of a fixed workload at each count, rounds interleaved (~10 ms a round on 2
    quiet cores; fewer rounds once one count takes under half the time of another): the ops a
    decode step is made of, matmuls and element-wise ops, with rows growing with the cores so
    each thread gets the same share."""
    import torch

    rows = 16 * max(counts)
    x, w, h = torch.randn(rows, 1024), torch.randn(1024, 1024), torch.randn(rows, 4096)
    times: dict[int, list[float]] = {n: [] for n in counts}
    with torch.inference_mode():
        for _ in range(rounds):
            for n in counts:
                set_threads(n)
                started = time.perf_counter()
                for _ in range(8):
                    torch.mm(x, w)
                    torch.nn.functional.silu(h).mul_(h)
                times[n].append(time.perf_counter() - started)
            medians = {n: statistics.median(t) for n, t in times.items()}
            if min(medians.values()) < 0.5 * max(medians.values()):
                break
    return medians


class StepThreads:
    """``with step_threads(num_tokens): run_step()`` in the thread that runs the model: applies the
    tuner's count to that thread's OpenMP pool (torch.set_num_threads is per calling thread once
    that thread has run a parallel op) and times the step for the tuner. Before the first step
    it times each candidate count on a fixed workload (``time_counts``) to start from the best.
    Without a tuner the count stays as it is. With a ``binding`` (runtime/thread_binding.py) the
    pool's threads are placed for the count, and the model thread is pinned for the step."""

    def __init__(self, tuner: ThreadTuner | None, get_threads: Callable[[], int], set_threads: Callable[[int], None],
                 time_counts: Callable[[list[int], Callable[[int], None]], dict[int, float]] = time_thread_counts,
                 binding: ThreadBinding | None = None, clock: Callable[[], float] = time.monotonic):
        self.tuner, self._get, self._set, self.binding, self._clock = tuner, get_threads, set_threads, binding, clock
        self._time_counts: Callable | None = time_counts if tuner is not None else None  # None once no check is due
        self._next_check: float | None = None  # clock time of the next start-up check; None before the first
        self._rechecks_left, self._recheck_gap = RECHECKS, RECHECK_FIRST_S

    @contextlib.contextmanager
    def __call__(self, tokens: int) -> Iterator[None]:
        if self._time_counts is not None:
            self._start_up_check()
        threads = self.tuner.next_threads(tokens) if self.tuner is not None else self._get()
        if self._get() != threads:
            self._set(threads)
        started = time.perf_counter()
        with self.binding.step(threads) if self.binding is not None else contextlib.nullcontext():
            yield
        if self.tuner is not None:
            self.tuner.record(threads, time.perf_counter() - started, tokens)

    def _start_up_check(self) -> None:
        """Before the first step, the start-up check chooses the count; while that leaves fewer
        threads than the cores, the check is taken again before the first step RECHECK_FIRST_S
        later, then after twice as long each time, RECHECKS times (a start-up burst of load fades;
        a busy core stays busy and keeps the count down). Then the probes alone decide."""
        if self._next_check is None:
            self.tuner.start_from(self._start_up_times())
        elif self._clock() < self._next_check:
            return
        else:
            self.tuner.start_from(self._start_up_times(), "the start-up check again")
            self._rechecks_left, self._recheck_gap = self._rechecks_left - 1, self._recheck_gap * 2
        if self.tuner.threads < self.tuner.max_threads and self._rechecks_left > 0:
            self._next_check = self._clock() + self._recheck_gap
        else:
            self._time_counts = None

    def _start_up_times(self) -> dict[int, float]:
        """Seconds per candidate count on the fixed workload. Times that would move to fewer threads
        are taken again after CONFIRM_PAUSE_S, and each count keeps its faster time: the first step
        (the warm-up request's) overlaps work in the server's API process, whose main thread was
        running at 2 of the 10 ms clock ticks in a 37-42 ms check (/proc/*/task/*/stat), and a tiny
        model's server started on 1 thread in 9 of 20 starts with one timing, in 2 of 20 with the
        second (AMD EPYC VM, 2 cores, nothing else running, 2026-12-06)."""
        counts = self.tuner.candidates()
        seconds = self._time_counts(counts, self._set)
        if self.tuner.preferred(seconds) < self.tuner.threads:
            time.sleep(CONFIRM_PAUSE_S)
            again = self._time_counts(counts, self._set)
            seconds = {n: min(seconds[n], again[n]) for n in counts}
        return seconds


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP thread pool (omp_pause_resource_all, OpenMP 5.0) -> whether
    the runtime did. libgomp keeps a pool per thread that ran a parallel op, and while the pools
    together hold more threads than there are cores, all of them stop spinning after 100
    iterations instead of ~300,000: a model built in one thread and stepped in another (an
    AsyncLLMEngine made in the main thread) ran 22% slower on 2 quiet cores (benchmarks/README.md,
    "A busy core"). The next parallel op in this thread starts a new pool."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.count(" ") >= 5 and "/" in line}
    except OSError:
        return False
    runtime = next((p for p in sorted(paths) if os.path.basename(p).startswith(OPENMP_RUNTIMES)), None)
    if runtime is None:
        return False
    try:
        released = ctypes.CDLL(runtime).omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
    except (OSError, AttributeError):
        return False
    if released:
        pool_released()
    return released


def model_step_threads(world_size: int, threads: int | None = None) -> StepThreads | None:
    """The per-step thread count and placement for a CPU worker that starts from ``threads``
    (torch's count when None): a tuner where the count may change, a binding where threads are
    bound (thread_binding.py), None where neither applies; logs which. Raises ValueError for a
    binding setting that cannot be met."""
    import torch

    threads = threads or torch.get_num_threads()
    binding = model_thread_binding(threads, world_size)
    if user_thread_count() is not None:
        reason = f"{USER_THREADS_ENV}={os.environ[USER_THREADS_ENV]} fixes the count"
    elif world_size > 1:
        reason = f"{world_size} ranks: each rank's step time includes waiting for the others"
    elif threads == 1:
        reason = "one core available"
    else:
        logger.info("OpenMP: %s (the cores torch found), tuned at run time: a count that runs steps "
                    "faster replaces it when other processes take cores (set %s to fix the count)",
                    _threads(threads), USER_THREADS_ENV)
        return StepThreads(ThreadTuner(threads), torch.get_num_threads, torch.set_num_threads, binding=binding)
    logger.info("OpenMP: %s, fixed: %s", _threads(threads), reason)
    if binding is None:
        return None
    return StepThreads(None, torch.get_num_threads, torch.set_num_threads, binding=binding)
