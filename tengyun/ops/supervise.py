"""`tengyun supervise`: when to restart the server, and how long to wait before starting it again.

Pure logic, driven by the CLI loop (entrypoints/cli/supervise.py), which owns the process,
polls /health, reads memory through the platform layer and, until the server is ready, its CPU
time (host/probe.py), then asks `Watchdog.check`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Reason(str, Enum):
    """Why a restart happened: the `reason` label of tengyun:supervisor_restarts_total."""

    MEMORY = "memory"  # memory use past --memory-threshold
    HEALTH = "health"  # /health failed --health-failures times in a row after being ready
    START_TIMEOUT = "start_timeout"  # /health not 200 within --start-timeout
    START_STALL = "start_stall"  # not ready, and (almost) no CPU used for --start-stall-timeout
    EXIT = "exit"  # the server exited on its own


@dataclass(frozen=True)
class WatchdogPolicy:
    memory_threshold: float = 0.95  # fraction of the device's (CPU: the host's) memory
    check_interval_s: float = 5.0
    health_failures: int = 3
    start_timeout_s: float = 900.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 300.0
    backoff_reset_s: float = 600.0  # healthy this long: the next restart starts the back-off over
    start_stall_timeout_s: float = 120.0  # 0: off
    stall_cpu_fraction: float = 0.01  # of one core: an idle server's event loop uses ~0.15%


@dataclass(frozen=True)
class Observation:
    """One look at the server, taken every check interval."""

    now: float  # monotonic seconds
    exit_code: int | None  # None while the process runs
    healthy: bool  # /health answered 200
    memory_used: int | None = None  # bytes, None when unreadable
    memory_total: int | None = None
    cpu_s: float | None = None  # CPU seconds used so far by the server and its children, None when unread


@dataclass(frozen=True)
class Decision:
    reason: Reason
    detail: str  # the log line's explanation, e.g. "memory 97.1% >= --memory-threshold 95.0%"
    graceful: bool  # SIGTERM and drain first (the process still runs)


class Backoff:
    """Delays before starting again: 0 for the first restart after a stable period, then
    initial, 2 x initial, ... capped at max. initial=1, max=8: 0, 1, 2, 4, 8, 8, ..."""

    def __init__(self, initial_s: float, max_s: float, reset_s: float):
        self.initial_s, self.max_s, self.reset_s = initial_s, max_s, reset_s
        self.streak = 0  # restarts since the server was last stable

    def next_delay(self) -> float:
        delay = 0.0 if self.streak == 0 else min(self.max_s, self.initial_s * 2 ** (self.streak - 1))
        self.streak += 1
        return delay

    def stable_for(self, seconds: float) -> None:
        if seconds >= self.reset_s:
            self.streak = 0


class Watchdog:
    """State of one supervised server across its restarts.

    started(now) when a process starts; check(obs) each interval -> a Decision or None;
    restarted() -> seconds to wait before starting the next process."""

    def __init__(self, policy: WatchdogPolicy):
        self.policy = policy
        self.backoff = Backoff(policy.backoff_initial_s, policy.backoff_max_s, policy.backoff_reset_s)
        self.restarts = 0
        self.started_at = 0.0
        self.ready_at: float | None = None
        self.failed_checks = 0
        self.progress_at, self.progress_cpu_s = 0.0, None  # the last start-up check that saw progress

    def started(self, now: float) -> None:
        self.started_at, self.ready_at, self.failed_checks = now, None, 0
        self.progress_at, self.progress_cpu_s = now, None

    def check(self, obs: Observation) -> Decision | None:
        p = self.policy
        if obs.exit_code is not None:
            return Decision(Reason.EXIT, f"the server exited with code {obs.exit_code}", graceful=False)
        if self.ready_at is None:
            if obs.healthy:
                self.ready_at = obs.now
                return None
            if obs.now - self.started_at > p.start_timeout_s:
                return Decision(Reason.START_TIMEOUT, f"/health not 200 within --start-timeout "
                                f"{p.start_timeout_s:g} s", graceful=True)
            return self._stall(obs)
        self.backoff.stable_for(obs.now - self.ready_at)
        self.failed_checks = 0 if obs.healthy else self.failed_checks + 1
        if self.failed_checks >= p.health_failures:
            return Decision(Reason.HEALTH, f"/health failed {self.failed_checks} checks in a row", graceful=True)
        if obs.memory_used is not None and obs.memory_total:
            used = obs.memory_used / obs.memory_total
            if used >= p.memory_threshold:
                return Decision(Reason.MEMORY, f"memory {used:.1%} ({obs.memory_used / 2**20:.0f} MiB of "
                                f"{obs.memory_total / 2**20:.0f} MiB) >= --memory-threshold "
                                f"{p.memory_threshold:g}", graceful=True)
        return None

    def _stall(self, obs: Observation) -> Decision | None:
        """While starting: a Decision when the server used under stall_cpu_fraction of a core
        over more than start_stall_timeout_s since it last progressed. Progress: CPU time grew
        by fraction x timeout. 120 s, 1%: 0.8 s of CPU from t=0 to t=121 -> stalled at 121;
        1.2 s by t=100 -> progress at 100, stalled only if under 1.2 s more by t=221."""
        p = self.policy
        if not p.start_stall_timeout_s or obs.cpu_s is None:
            return None
        progress_s = p.stall_cpu_fraction * p.start_stall_timeout_s
        if self.progress_cpu_s is None or obs.cpu_s - self.progress_cpu_s >= progress_s:
            self.progress_at, self.progress_cpu_s = obs.now, obs.cpu_s
            return None
        idle_s = obs.now - self.progress_at
        if idle_s <= p.start_stall_timeout_s:
            return None
        return Decision(Reason.START_STALL, f"start-up stalled: not ready, and {obs.cpu_s - self.progress_cpu_s:.2f} "
                        f"s of CPU in the last {idle_s:.0f} s (under {p.stall_cpu_fraction:.0%} of a core) "
                        f"> --start-stall-timeout {p.start_stall_timeout_s:g} s (raise it, or 0 turns this off, "
                        f"if start-up waits on other nodes)", graceful=True)

    def restarted(self) -> float:
        self.restarts += 1
        return self.backoff.next_delay()
