"""`tengyun serve --headless`: nodes 1..N-1 of a multi-node launch. No engine and no OpenAI API
here: this node's ranks (executor/multiproc_executor.run_headless, in the main thread) and a
small app on --host/--port (a uvicorn thread) that makes the node observable and supervisable.
A --headless data-parallel node (headless_replica_node.py) serves the same app over its replicas
(serve_headless, build_headless_app: a node answers unavailable_reason, health_json, collectors
and not_here):

    GET /health          200 while every rank of this node is alive and has joined the world;
                         503 naming the rank (or what the node waits for) otherwise
    GET /health/detail   the same status code, with each rank's state and the devices' sample
    GET /metrics         the device gauges (device_metrics.py), tengyun:rank_alive / rank_joined
                         {node, node_rank, rank} and tengyun:server_ready (what /health answers)
    GET /version
Anything else needs the key when --api-key is set (401 without it, as on node 0), then 404.

Life of the process:
    bind the port (503 "waiting for node 0") -> linked, ranks starting (503 naming them) ->
    all joined (200) -> a rank exits or node 0's engine goes: 503 naming why for
    EXIT_LINGER_S, exit 1.  SIGTERM / SIGINT: the ranks are terminated, exit 0.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import Pipe
from typing import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from tengyun import __version__
from tengyun.config import EngineConfig
from tengyun.distributed.rank_info import node_ranks
from tengyun.entrypoints.openai.device_metrics import PREFIX, DeviceCollector, DeviceSampler
from tengyun.entrypoints.openai.middleware import bearer_matches, error_response, route_path
from tengyun.entrypoints.openai.server_config import ServerConfig
from tengyun.executor.node_link import NodeObserver, describe_ranks
from tengyun.platforms import platform_class

logger = logging.getLogger("tengyun.server")
OPEN_PATHS = ("/health", "/health/detail", "/metrics", "/version")  # probes and scrapers carry no key
EXIT_LINGER_S = 3.0  # after a failure: /health 503 naming it, for probes and scrapers, before exit 1
STARTUP_BIND_S = 30.0  # how long the port may take to bind before the node gives up


@dataclass
class RankState:
    rank: int
    pid: int | None = None
    joined: bool = False
    exit_code: int | None = None  # None while running (or not started)
    memory: dict | None = None  # its MemoryReport once joined (worker/memory_profile.py)

    def as_json(self) -> dict:
        state = "exited" if self.exit_code is not None else "joined" if self.joined else \
            "starting" if self.pid else "not_started"
        return {"rank": self.rank, "pid": self.pid, "state": state, "exit_code": self.exit_code, "memory": self.memory}


class HeadlessNode(NodeObserver):
    """This node's ranks as run_headless reports them (main thread), read by the app (uvicorn's
    thread): every field is replaced whole, so a reader never sees half an update."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.ranks = {r: RankState(r) for r in node_ranks(config.world_size, config.nnodes, config.node_rank)}
        self.is_linked = False
        self.ended: str | None = None  # why run_headless returned, once it has
        self._stop_read, self._stop_write = Pipe(duplex=False)
        super().__init__(stop_handle=self._stop_read)

    def request_stop(self) -> None:
        """From a signal handler: run_headless terminates the ranks and returns 0."""
        self._stop_write.send_bytes(b"stop")

    def linked(self) -> None:
        self.is_linked = True

    def rank_started(self, rank: int, pid: int) -> None:
        self.ranks[rank] = RankState(rank, pid)

    def rank_joined(self, rank: int, memory: dict | None = None) -> None:
        self.ranks[rank] = RankState(rank, self.ranks[rank].pid, joined=True, memory=memory)

    def rank_exited(self, rank: int, pid: int, code: int) -> None:
        old = self.ranks[rank]
        if old.exit_code is None:
            self.ranks[rank] = RankState(rank, pid, old.joined, code if code is not None else -1, old.memory)

    def unavailable_reason(self) -> str | None:
        """Why /health answers 503; None while every rank is alive and joined."""
        c = self.config
        exited = [s for s in self.ranks.values() if s.exit_code is not None]
        if exited:
            s = exited[0]
            return (f"worker rank {s.rank} (pid {s.pid}) on node {c.node_rank} exited with code {s.exit_code}; "
                    f"this node's ranks are stopping (see its log).")
        if self.ended is not None:
            return self.ended
        if not self.is_linked:
            return (f"node {c.node_rank} is waiting for node 0's engine at {c.master_addr}:{c.master_port + 1} "
                    f"(the node link) to accept it.")
        starting = [s.rank for s in self.ranks.values() if not s.joined]
        if starting:
            return f"{describe_ranks(starting)} of node {c.node_rank} started but not yet joined the world."
        return None

    def collectors(self, hostname: str) -> list:
        return [RankCollector(self, hostname)]

    def not_here(self) -> str:
        """The 404's advice: where the API is."""
        return f"node {self.config.node_rank} is --headless; send API requests to node 0 ({self.config.master_addr})."

    def health_json(self, sampler: DeviceSampler | None) -> dict:
        reason = self.unavailable_reason()
        sample = sampler.latest if sampler else None
        return {"status": "ok" if reason is None else "unavailable", "reason": reason, "headless": True,
                "node_rank": self.config.node_rank, "master": f"{self.config.master_addr}:{self.config.master_port}",
                "ranks": [s.as_json() for s in self.ranks.values()], "device_type": self.config.device_type,
                "node": sampler.node if sampler else None,
                **(sample.as_json() if sample is not None else {"devices": None, "links": None})}


class RankCollector:
    """tengyun:rank_alive and tengyun:rank_joined{node, node_rank, rank} at scrape time."""

    def __init__(self, node: HeadlessNode, hostname: str):
        self.node, self.hostname = node, hostname

    def describe(self):
        return []

    def collect(self):
        labels = ["node", "node_rank", "rank"]
        alive = GaugeMetricFamily(PREFIX + "rank_alive", "1 while the rank's process runs (a --headless node's "
                                  "ranks), 0 once it exited.", labels=labels)
        joined = GaugeMetricFamily(PREFIX + "rank_joined", "1 once the rank joined the world (loaded, KV cache "
                                   "sized with every other rank).", labels=labels)
        for s in list(self.node.ranks.values()):
            values = [self.hostname, str(self.node.config.node_rank), str(s.rank)]
            alive.add_metric(values, float(s.pid is not None and s.exit_code is None))
            joined.add_metric(values, float(s.joined and s.exit_code is None))
        yield alive
        yield joined


def build_headless_app(node: HeadlessNode, server: ServerConfig, sampler: DeviceSampler | None) -> FastAPI:
    """``node``: a HeadlessNode, or any object answering its unavailable_reason, health_json,
    collectors and not_here (headless_replica_node.ReplicaNode)."""
    registry = CollectorRegistry()
    ready = Gauge(PREFIX + "server_ready", "1 when /health answers 200, else 0.", registry=registry)
    ready.set_function(lambda: float(node.unavailable_reason() is None))
    for collector in node.collectors(sampler.node if sampler else socket.gethostname()):
        registry.register(collector)
    if sampler is not None:
        registry.register(DeviceCollector(sampler))
    app = FastAPI(title="Tengyun headless node", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.middleware("http")
    async def gate(request: Request, call_next):
        if route_path(request.scope) not in OPEN_PATHS and server.required_api_key and \
                not bearer_matches(request.scope, server.required_api_key):
            return error_response(401, "Invalid or missing API key: send it as 'Authorization: Bearer KEY'.")
        return await call_next(request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405):
            return error_response(exc.status_code, f"No route {request.method} {request.url.path}: "
                                  f"{node.not_here()}")
        return error_response(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health() -> Response:
        reason = node.unavailable_reason()
        return Response(status_code=200) if reason is None else error_response(503, reason)

    @app.get("/health/detail")
    async def health_detail() -> JSONResponse:
        body = node.health_json(sampler)
        return JSONResponse(body, status_code=200 if body["reason"] is None else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    return app


def run_headless_node(config: EngineConfig, server: ServerConfig) -> int:
    """Serve the node's app in a thread while run_headless runs the ranks here; the exit code is
    run_headless's (1 once the port cannot be bound)."""
    from tengyun.executor.multiproc_executor import run_headless

    node = HeadlessNode(config)
    return serve_headless(node, server, config.device_type, f"node {config.node_rank}",
                          lambda: run_headless(config, node))


def serve_headless(node, server: ServerConfig, device_type: str, name: str, run: Callable[[], int]) -> int:
    """``node``'s app (build_headless_app) on --host/--port in a uvicorn thread while ``run()``
    runs the node's processes here; SIGTERM / SIGINT call node.request_stop(). A non-zero exit
    sets node.ended (503 naming it) for EXIT_LINGER_S first. -> run()'s code, 1 when the port
    cannot be bound. ``name``: "node 1", how the log and errors call it."""
    sampler = DeviceSampler(platform_class(device_type)(), server.device_metrics_interval) \
        if server.device_metrics_interval else None
    uv = uvicorn.Server(uvicorn.Config(
        build_headless_app(node, server, sampler), host=server.host, port=server.port, uds=server.uds,
        log_level=server.uvicorn_log_level, access_log=not server.disable_uvicorn_access_log, lifespan="off"))
    thread = threading.Thread(target=uv.run, daemon=True, name="tengyun-headless-http")
    thread.start()
    deadline = time.monotonic() + STARTUP_BIND_S
    while not uv.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not uv.started:
        print(f"error: {name} could not serve /health on {server.host}:{server.port} (--port): "
              f"see the lines above; pick a free --port.", file=sys.stderr)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):  # before the line below, which supervisors and tests wait for
        signal.signal(sig, lambda s, f: node.request_stop())
    logger.info("Headless %s: /health and /metrics on %s", name,
                f"unix socket {server.uds}" if server.uds else f"http://{server.host}:{server.port}")
    if sampler:
        sampler.start()
    code = run()
    if code != 0:
        node.ended = f"{name} stopped (exit {code}): see its log for the cause."
        time.sleep(EXIT_LINGER_S)
    if sampler:
        sampler.stop()
    uv.should_exit = True
    thread.join(10.0)
    return code
