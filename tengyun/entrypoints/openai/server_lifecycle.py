"""ServerLifecycle: where the server is in its life, which decides /health and the exit code.

    loading --engine_started()--> warming_up --ready--> running --begin_drain()--> draining -> exit 0
       |                              |                    |
       +--- failed (load_error: exit 2 for a configuration ValueError, else 1)
                                      +--------------------+--- dead (the engine loop died: exit 1)

While anything but running (and not draining), API requests get 503 with unavailable_reason().
Draining: no new requests; in-flight ones finish, or are aborted once --shutdown-timeout passes,
and the server exits 0 when none is left (5 s after the abort at the latest).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Gauge

from tengyun.engine.async_engine import AsyncEngineBase
from tengyun.entrypoints.openai.server_config import ServerConfig

logger = logging.getLogger("tengyun.server")
ABORT_GRACE_S = 5.0  # after the in-flight requests are aborted, how long their answers may take


class ServerLifecycle:
    def __init__(self, server: ServerConfig, registry: CollectorRegistry):
        self.shutdown_timeout = server.shutdown_timeout
        self.engine: AsyncEngineBase | None = None  # set once loaded; warm-up runs through it
        self.ready = False  # warmed up: /health 200 unless draining or dead
        self.load_error: BaseException | None = None
        # what start-up waits for beyond loading, for /health's 503 (data-parallel replicas on other nodes)
        self.starting_note: Callable[[], str | None] | None = None
        self.draining = False
        self.drain_deadline = 0.0  # time.monotonic() when in-flight requests are aborted
        self.aborted_in_flight = False
        self.in_flight = 0  # API requests between arrival and their last byte
        self.generating = 0  # generation requests in flight: GET /load with --enable-server-load-tracking
        # for the alerting rules (`tengyun deploy alerts`); livemin: with --api-server-count N, 1 only while
        # every API process is ready (each sets its own, api_server_pool.py; set_function is not read there)
        self.ready_gauge = Gauge("tengyun:server_ready", "1 when /health answers 200 (loaded, warm, not draining, "
                                 "engine alive), else 0.", registry=registry, multiprocess_mode="livemin")
        self.ready_gauge.set_function(lambda: float(self.unavailable_reason() is None))

    def engine_started(self, engine: AsyncEngineBase) -> None:
        self.engine = engine

    def engine_state(self) -> str:
        """"loading" -> "warming_up" -> "running"; "failed" (never started) or "dead" (its loop died)."""
        if self.load_error is not None:
            return "failed"
        if self.engine is None:
            return "loading"
        if self.engine.dead_error is not None:  # data parallel: a replica died, the others may finish theirs
            return "dead"
        return "running" if self.ready else "warming_up"

    def begin_drain(self) -> None:
        self.draining = True
        self.drain_deadline = time.monotonic() + self.shutdown_timeout

    def exit_code(self) -> int | None:
        """Checked every 0.1 s by the server: None keeps serving, a number shuts down with it."""
        if self.load_error is not None:
            return 2 if isinstance(self.load_error, ValueError) else 1
        if self.engine is not None and self.engine.errored:
            return 1
        if self.draining:
            if self.in_flight == 0:
                return 0
            if time.monotonic() > self.drain_deadline:
                if not self.aborted_in_flight:
                    logger.warning("--shutdown-timeout passed: aborting %d in-flight request(s)", self.in_flight)
                    self.aborted_in_flight = True
                    if self.engine is not None:
                        self.engine.abort_all()
                elif time.monotonic() > self.drain_deadline + ABORT_GRACE_S:
                    return 0
        return None

    def unavailable_reason(self) -> str | None:
        """Why /health and API requests get 503; None when the server takes requests."""
        if self.engine is not None and self.engine.dead_error is not None:
            return f"The engine is not running: {self.engine.dead_error}"
        if self.draining:
            return "The server is shutting down and accepts no new requests."
        if self.load_error is not None:
            return f"The engine failed to start: {self.load_error}"
        if not self.ready:
            note = self.starting_note() if self.starting_note is not None else None
            return (f"The server is starting (loading the model, warming up{f'; {note}' if note else ''}); "
                    f"retry when /health returns 200.")
        return None
