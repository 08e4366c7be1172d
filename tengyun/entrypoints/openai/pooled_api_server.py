"""One API process of several (`--api-server-count N`), forked by the supervisor (api_server_pool.py).

It is the single-process server (EngineHost, build_app, DrainingServer) with these differences:
- its engine is a SharedEngineClient on its own pipe pair to the one engine process, and it
  accepts on the listening socket the supervisor bound (the kernel hands each connection to one
  of the N processes);
- process 0 warms the engine up once all N have loaded their tokenizers, and records the
  engine's metrics; the others wait for that warm-up instead of running their own (their
  warm-up tokens would count as traffic), so all N turn /health 200 within WARM_POLL_S;
- /metrics serves every process's metrics merged (multiprocess_metrics.py), and each process
  sets its own tengyun:server_ready each tick;
- a drain the supervisor asks for (it got SIGTERM, or a sibling died) starts as a SIGTERM here;
- responses carry `x-tengyun-api-server: <index>`, so a client or a test sees which one answered.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from typing import Any

from tengyun.engine.client_router import METRICS_OWNER
from tengyun.engine.engine_process import _die_with_parent
from tengyun.engine.shared_engine_process import SharedEngineClient, SharedEngineLaunch
from tengyun.entrypoints.openai.http_server import build_host
from tengyun.entrypoints.openai.draining_server import DrainingServer
from tengyun.entrypoints.openai.engine_host import EngineHost
from tengyun.entrypoints.openai.multiprocess_metrics import merged_registry
from tengyun.entrypoints.openai.routes import build_app

logger = logging.getLogger("tengyun.server")
API_SERVER_HEADER = b"x-tengyun-api-server"
WARM_POLL_S = 0.01


class PooledEngineHost(EngineHost):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.scrape_registry = merged_registry(self.metrics, not self.server.disable_vllm_metric_aliases,
                                               self.server.show_hidden_metrics_for_version)

    async def _warm_up(self, engine: SharedEngineClient, tokenizer: Any) -> None:
        """The rendezvous of shared_engine_process.WarmUpRendezvous, in place of each one's warm-up."""
        rendezvous = engine.rendezvous
        with rendezvous.loaded.get_lock():
            rendezvous.loaded.value += 1
        if engine.index == METRICS_OWNER:
            await _until(lambda: rendezvous.loaded.value == rendezvous.size, engine)
            await EngineHost._warm_up(engine, tokenizer)
            rendezvous.warm.set()
        else:
            await _until(rendezvous.warm.is_set, engine)


async def _until(condition: Any, engine: SharedEngineClient) -> None:
    """Poll ``condition`` every WARM_POLL_S; a dead engine raises (a dead sibling: the supervisor drains us)."""
    while not condition():
        if engine.errored:
            raise RuntimeError(engine.dead_error)
        await asyncio.sleep(WARM_POLL_S)


class PooledServer(DrainingServer):
    def __init__(self, config: Any, lifecycle: Any, drain: Any):
        super().__init__(config, lifecycle)
        self.drain = drain  # multiprocessing Event: the supervisor asks every API process to drain

    async def on_tick(self, counter: int) -> bool:
        if self.drain.is_set() and not self.lifecycle.draining and not self.should_exit:
            self.handle_exit(signal.SIGTERM, None)
        self.lifecycle.ready_gauge.set(float(self.lifecycle.unavailable_reason() is None))
        return await super().on_tick(counter)


class ApiServerHeader:
    """ASGI middleware adding `x-tengyun-api-server: <index>` to every HTTP response."""

    def __init__(self, app: Any, index: int):
        self.app = app
        self.header = (API_SERVER_HEADER, str(index).encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)


def api_process_main(index: int, launch: SharedEngineLaunch, drain: Any, config: Any, server: Any, models: Any,
                     sockets: list[socket.socket]) -> None:
    """The target of API process ``index``: serve until drained; its exit code is the server's (outcome())."""
    launch.close_others(index)  # a sibling's pipes held here would hide that sibling's death from the engine
    sock = sockets[index]
    for other in sockets:
        if other is not sock:
            other.close()  # a sibling's socket held here would keep taking connections after that sibling died
    _die_with_parent()
    _prefix_log_lines(index)
    host = build_host(config, server, launch.client(index), models, host_class=PooledEngineHost)
    app = build_app(host)
    app.add_middleware(ApiServerHeader, index=index)
    uvicorn_server = PooledServer.for_app(app, server, host.lifecycle, drain=drain)
    asyncio.run(uvicorn_server.serve(sockets=[sock]))
    sys.exit(uvicorn_server.outcome())


def _prefix_log_lines(index: int) -> None:
    """`[api 1] INFO ...`: the N processes write to one log."""
    for handler in logging.getLogger().handlers:
        fmt = handler.formatter._fmt if handler.formatter else "%(message)s"  # noqa: SLF001
        handler.setFormatter(logging.Formatter(f"[api {index}] {fmt}"))
