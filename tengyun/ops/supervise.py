"""`tengyun supervise`: when to restart the server, and how long to wait before starting it again.

Pure logic, driven by the CLI loop (entrypoints/cli/supervise.py), which owns the process,
polls /health and reads memory through the platform layer, then asks `Watchdog.check`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Reason(str, Enum):
    """Why a restart happened: the `reason` label of tengyun:supervisor_restarts_total."""

    MEMORY = "memory"  # memory use past --memory-threshold
    HEALTH = "health"  # /health failed --health-failures times in a row after being ready
    START_TIMEOUT = "start_timeout"  # /health not 200 within --start-timeout
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


@dataclass(frozen=True)
class Observation:
    """One look at the server, taken every check interval."""

    now: float  # monotonic seconds
    exit_code: int | None  # None while the process runs
    healthy: bool  # /health answered 200
    memory_used: int | None = None  # bytes, None when unreadable
    memory_total: int | None = None


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

    def started(self, now: float) -> None:
        self.started_at, self.ready_at, self.failed_checks = now, None, 0

    def check(self, obs: Observation) -> Decision | None:
        p = self.policy
        if obs.exit_code is not None:
            return Decision(Reason.EXIT, f"the server exited with code {obs.exit_code}", graceful=False)
        if self.ready_at is None:
            if obs.healthy:
                self.ready_at = obs.now
            elif obs.now - self.started_at > p.start_timeout_s:
                return Decision(Reason.START_TIMEOUT, f"/health not 200 within --start-timeout "
                                f"{p.start_timeout_s:g} s", graceful=True)
            return None
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

    def restarted(self) -> float:
        self.restarts += 1
        return self.backoff.next_delay()
