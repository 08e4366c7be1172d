"""DrainingServer: uvicorn, with SIGTERM / SIGINT starting a drain instead of an immediate stop,
and the lifecycle's exit code: 0 after a drain, 1 if the engine died, 2 if it could not start
(configuration). A second signal stops at once. A dead engine keeps /health 503, naming why (a rank
on another node, say), for DEAD_LINGER_S before the exit, so probes and scrapers see the cause."""

from __future__ import annotations

import logging
import socket
import sys
import time
from typing import Any

import uvicorn

from tengyun.entrypoints.openai.server_config import ServerConfig
from tengyun.entrypoints.openai.server_lifecycle import ServerLifecycle

logger = logging.getLogger("tengyun.server")
DEAD_LINGER_S = 3.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, lifecycle: ServerLifecycle):
        super().__init__(config)
        self.lifecycle = lifecycle
        self.exit_code = 0
        self._dead_since: float | None = None

    @classmethod
    def for_app(cls, app: Any, server: ServerConfig, lifecycle: ServerLifecycle, **extra: Any) -> "DrainingServer":
        """uvicorn serving ``app`` where --host/--port or --uds say; ``extra``: a subclass's own arguments."""
        return cls(uvicorn.Config(app, host=server.host, port=server.port, uds=server.uds,
                                  log_level=server.uvicorn_log_level, access_log=not server.disable_uvicorn_access_log,
                                  timeout_graceful_shutdown=5, lifespan="on"), lifecycle, **extra)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        log_http_parser(self.config.http_protocol_class)
        await super().startup(sockets)

    def outcome(self) -> int:
        """The exit code once serve() returned; why it is not 0 printed to stderr."""
        lifecycle = self.lifecycle
        if lifecycle.load_error is not None:
            print(f"error: {lifecycle.load_error}", file=sys.stderr)
        elif self.exit_code == 1:
            why = lifecycle.engine.dead_error if lifecycle.engine else "the engine stopped"
            print(f"error: {why}", file=sys.stderr)
        elif not self.started:
            return 1  # the port could not be bound; uvicorn logged why
        return self.exit_code

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.lifecycle.draining or self.should_exit:  # a second signal: stop now
            self.should_exit = self.force_exit = True
            return
        logger.info("Received signal %d: no new requests; finishing %d in-flight request(s) within %.0f s",
                    sig, self.lifecycle.in_flight, self.lifecycle.shutdown_timeout)
        self.lifecycle.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        should_exit = await super().on_tick(counter)
        code = self.lifecycle.exit_code()
        if code is not None and self.lifecycle.engine is not None and self.lifecycle.engine.errored \
                and not self.force_exit:
            self._dead_since = self._dead_since or time.monotonic()
            if time.monotonic() - self._dead_since < DEAD_LINGER_S:
                return should_exit
        if code is not None:
            self.exit_code = code
            return True
        return should_exit


def log_http_parser(protocol_class: type) -> None:
    """Which HTTP/1.1 implementation uvicorn serves with: httptools (a C parser, its choice when
    installed) or h11 (pure Python), which costs the API process more CPU for every streamed chunk."""
    if protocol_class.__name__ == "H11Protocol":
        logger.warning("HTTP/1.1: uvicorn's h11 (pure Python; httptools is not installed): each streamed "
                       "token costs the API process more CPU, which it takes from the engine on a small "
                       "machine. `pip install httptools` to serve with the C parser.")
    else:
        logger.info("HTTP/1.1: uvicorn's %s", protocol_class.__name__)
