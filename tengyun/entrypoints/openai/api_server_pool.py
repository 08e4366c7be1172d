"""`tengyun serve --api-server-count N`: N API processes in front of one engine process.

    supervisor (this process): checks -> multiprocess metrics on -> fork the engine process
        -> N listening sockets on --port (SO_REUSEPORT) -> fork API processes 0..N-1
           (pooled_api_server.py), process i keeping socket i -> watch

One process parses HTTP, renders chat templates, tokenises and streams SSE for every request; at
high concurrency that one core is the ceiling. Here the kernel spreads the connections over N
processes, each with its own tokenizer, each talking to the one engine over a pipe pair of its
own (ClientRouter). With --uds the N processes share one socket (see listening_sockets).

The supervisor answers no HTTP and holds no thread, so it can fork. It watches its children:
    SIGTERM / SIGINT    -> every API process drains as one server would (a second signal: they stop
                           now); each one drained leaves the engine; the engine stops when all left
    an API process dies -> logged; the others drain; exit 1 (or the code it exited with)
    the engine dies     -> every API process reports it (/health 503) and exits 1; exit 1
    a start-up failure  -> each API process exits 2 (configuration) or 1; so does the supervisor
The children die with the supervisor (PR_SET_PDEATHSIG), so none outlives it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
from multiprocessing import get_context
from multiprocessing.connection import wait
from typing import Any

from tengyun import __version__
from tengyun.engine.engine_process import SHUTDOWN_GRACE_S, engine_in_thread_reason
from tengyun.engine.shared_engine_process import SharedEngineLaunch
from tengyun.entrypoints.openai.multiprocess_metrics import (
    enable_multiprocess_metrics, mark_process_dead, remove_metrics_dir,
)
from tengyun.entrypoints.openai.pooled_api_server import api_process_main
from tengyun.entrypoints.openai.responses_store import ResponsesStore
from tengyun.entrypoints.openai.server_config import ServerConfig
from tengyun.entrypoints.openai.serving_models import runtime_lora_updates_allowed
from tengyun.platforms import platform_class

logger = logging.getLogger("tengyun.server")
WATCH_INTERVAL_S = 0.2  # how soon a signal is passed on while no child exits
LISTEN_BACKLOG = 2048  # uvicorn's default


def pool_problem(config: Any, server: ServerConfig) -> str | None:
    """Why --api-server-count N (above 1) cannot serve this configuration; None when it can."""
    n = server.api_server_count
    if config.headless:
        return f"--api-server-count {n} cannot be used with --headless: a headless node serves no API; drop one."
    if getattr(config, "data_parallel_size", 1) > 1:
        return (f"--api-server-count {n} with --data-parallel-size {config.data_parallel_size} is not supported yet: "
                f"use --api-server-count 1 (one API process in front of the replicas) or --data-parallel-size 1.")
    if runtime_lora_updates_allowed():
        return (f"VLLM_ALLOW_RUNTIME_LORA_UPDATING cannot be used with --api-server-count {n}: each API process "
                f"would hold its own adapters; unset it or use --api-server-count 1.")
    reason = engine_in_thread_reason(platform_class(config.device_type).fork_safe)
    if reason is not None:
        return f"--api-server-count {n} needs the engine in a process of its own, but {reason}: use 1."
    return None


def run_api_server_pool(config: Any, server: ServerConfig, models: Any) -> int:
    """Serve until drained or failed; the exit code as a single server's (0, 1, 2)."""
    if problem := pool_problem(config, server):
        raise ValueError(problem)  # exit 2, before anything starts
    if ResponsesStore().enabled:
        logger.info("--api-server-count %d: each API process keeps its own /v1/responses store, so a "
                    "previous_response_id or GET /v1/responses/{id} reaching another process gets a 404",
                    server.api_server_count)
    metrics_dir = enable_multiprocess_metrics()
    try:
        launch = SharedEngineLaunch(config, server.api_server_count)  # first: this process has one thread
        try:
            sockets = listening_sockets(server)
        except OSError as e:  # the port in use, say
            logger.error("Cannot listen on %s: %s", _where(server), e)
            launch.process.kill()
            launch.process.join()
            return 1
        drain = get_context("fork").Event()  # set: every API process drains (pooled_api_server.PooledServer)
        members = _fork_api_processes(launch, drain, config, server, models, sockets)
        launch.close_others()
        for sock in set(sockets):
            sock.close()
        return PoolSupervisor(members, launch, drain).run()
    finally:
        remove_metrics_dir(metrics_dir)


def listening_sockets(server: ServerConfig) -> list[socket.socket]:
    """One listening socket per API process, all on --host:--port with SO_REUSEPORT: the kernel
    spreads connections over them evenly (one socket shared by all would go to whichever process
    woke first, and asyncio accepts up to 100 at a time: a burst lands in one process). A Unix
    socket (--uds) cannot be bound twice: there the N processes share one."""
    if server.uds:
        return [_unix_socket(server.uds)] * server.api_server_count
    sockets = []
    try:
        for _ in range(server.api_server_count):
            sock = socket.socket(socket.AF_INET6 if ":" in server.host else socket.AF_INET)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((server.host, server.port))
            sock.listen(LISTEN_BACKLOG)  # now: connections wait in the queue while the API process starts
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _unix_socket(path: str) -> socket.socket:
    """Listening on ``path``; a socket file a previous server left there is replaced (as asyncio's
    create_unix_server, which a single API process uses, does), anything else is an error."""
    if os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
        os.remove(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o666)  # as uvicorn makes it
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def _where(server: ServerConfig) -> str:
    return f"unix socket {server.uds}" if server.uds else f"http://{server.host}:{server.port}"


def _fork_api_processes(launch: SharedEngineLaunch, drain: Any, config: Any, server: ServerConfig, models: Any,
                        sockets: list[socket.socket]) -> list:
    context = get_context("fork")
    members = [context.Process(target=api_process_main, args=(i, launch, drain, config, server, models, sockets),
                               name=f"tengyun-api-{i}", daemon=False) for i in range(server.api_server_count)]
    for member in members:
        member.start()
    logger.info("Tengyun %s: %d API server processes (pids %s) on %s in front of engine process %d", __version__,
                len(members), ", ".join(str(m.pid) for m in members), _where(server), launch.process.pid)
    return members


class PoolSupervisor:
    def __init__(self, members: list, launch: SharedEngineLaunch, drain: Any):
        self.members = members  # multiprocessing Processes, index = API process index
        self.launch = launch
        self.engine = launch.process
        self.drain = drain
        self.signals = 0  # SIGTERM / SIGINT received
        self.failure: int | None = None  # the exit code a failed child gives the server

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        alive, engine_reported, forced = set(self.members), False, False
        while alive:
            wait([m.sentinel for m in alive] + ([] if engine_reported else [self.engine.sentinel]), WATCH_INTERVAL_S)
            if self.signals and not self.drain.is_set():
                logger.info("Received a signal: every API process drains")
                self.drain.set()
            if self.signals > 1 and not forced:  # a second signal: each API process stops now
                forced = True
                for member in alive:
                    member.terminate()
            for member in [m for m in alive if m.exitcode is not None]:
                alive.discard(member)
                self._on_member_exit(member)
            if not engine_reported and self.engine.exitcode is not None:
                engine_reported = True
                logger.error("The engine process %d exited (code %s)", self.engine.pid, self.engine.exitcode)
        self._stop_engine()
        return self.failure or 0

    def _on_signal(self, sig: int, frame: Any) -> None:
        self.signals += 1

    def _on_member_exit(self, member: Any) -> None:
        mark_process_dead(member.pid)
        code = member.exitcode
        if code == 0 and self.drain.is_set():
            return
        if self.failure is not None:  # the first failure was logged; the rest follow it
            logger.info("API server process %s (pid %d) exited (code %s)", member.name, member.pid, code)
            return
        self.failure = code if code and code > 0 else 1
        logger.error("API server process %s (pid %d) exited (code %s): the other API processes drain and the "
                     "server exits %d", member.name, member.pid, code, self.failure)
        self.drain.set()

    def _stop_engine(self) -> None:
        """Every API process has left it; it stops by itself once loaded. One still loading reads no
        message, and is killed at once (as a single server does)."""
        if self.engine.exitcode is None:
            self.engine.join(SHUTDOWN_GRACE_S if self.launch.rendezvous.warm.is_set() else 0)
        if self.engine.exitcode is None:
            self.engine.kill()
            self.engine.join(5.0)
