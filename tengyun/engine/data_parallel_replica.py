"""The replicas behind a DataParallelClient: LocalReplica, an engine process this API process
forked (two pipes), and RemoteReplica, one running on a --headless node (one TCP connection from
engine/data_parallel_link.py). Both speak engine_process.py's protocol, so the client routes,
aborts, steps waves and names deaths the same way for either.

    LocalReplica  i: EngineProcessClient over pipes            where: "pid 4241"
    RemoteReplica j: EngineProcessClient over one socket        where: "pid 5120 on 10.0.0.2"
                     (attached once node j's hello is welcomed; until then "not connected")

A RemoteReplica not attached within --distributed-timeout of start() fails its start (the API
node exits naming the replica and the flags); one whose connection ends while nobody asked it to
stop is dead: "The connection to its node 10.0.0.2 closed ...". Pure Python: no torch import.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

from tengyun.engine.async_engine import AddRequest, EngineDead, Shutdown
from tengyun.engine.engine_process import SHUTDOWN_GRACE_S, EngineProcessClient, EngineReady, EngineStartFailed
from tengyun.sizing.data_parallel import rpc_port

logger = logging.getLogger(__name__)


class ReplicaHooks:
    """What DataParallelClient hears from a replica besides its outputs."""

    on_add: Callable[[], None] | None = None  # after each request is sent to it
    on_dead: Callable[[], None] | None = None  # after its death is recorded (dead_error set)

    def _send(self, message: Any) -> None:
        super()._send(message)
        if isinstance(message, AddRequest) and self.on_add is not None:
            self.on_add()

    def _dispatch(self, message: Any) -> None:
        super()._dispatch(message)
        if isinstance(message, EngineDead) and self.on_dead is not None:
            self.on_dead()


class LocalReplica(ReplicaHooks, EngineProcessClient):
    """A replica in an engine process of this node (EngineProcessClient.launch)."""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def where(self) -> str:
        return f"pid {self.process.pid}"


class RemoteReplica(ReplicaHooks, EngineProcessClient):
    """Replica ``index`` on another node: the same client over the connection that node opens."""

    def __init__(self, config: Any, index: int):
        super().__init__(config, process=None, requests=None, results=None)
        self.index = index
        self.address: str | None = None  # the node's, once attached
        self.pid: int | None = None  # its engine process's there, once ready
        self._lock = threading.Lock()
        self._attached = threading.Event()
        self._closed = threading.Event()  # its connection ended
        self._gave_up = False  # never attached within --distributed-timeout

    @property
    def where(self) -> str:
        if self.address is None:
            return "not connected"
        return f"pid {self.pid} on {self.address}" if self.pid is not None else f"on {self.address}"

    # ----- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        threading.Thread(target=self._await_node, name=f"tengyun-dp-wait-{self.index}", daemon=True).start()

    def attach(self, conn: Connection, address: str) -> bool:
        """From the listener: the node's welcomed connection; False when too late (gave up, stopping)."""
        with self._lock:
            if self._gave_up or self._stopping or self._attached.is_set():
                return False
            self._requests = self._results = conn  # one socket both ways
            self.address = address
            self._attached.set()
        logger.info("Data parallel: replica %d connected from %s", self.index, address)
        threading.Thread(target=self._send_forever, name=f"tengyun-dp-send-{self.index}", daemon=True).start()
        threading.Thread(target=self._read_forever, name=f"tengyun-dp-read-{self.index}", daemon=True).start()
        return True

    def _await_node(self) -> None:
        wait_s = self.config.distributed_timeout
        if self._attached.wait(wait_s):
            return
        with self._lock:
            if self._attached.is_set() or self._stopping:
                return
            self._gave_up = True
        address = f"{self.config.data_parallel_address or '*'}:{rpc_port(self.config)}"
        self._post(EngineStartFailed(TimeoutError(
            f"data-parallel replica {self.index} never connected: no --headless node with --data-parallel-start-rank "
            f"{self.index} or below (and --data-parallel-size-local reaching it) joined at {address} "
            f"(--data-parallel-address, --data-parallel-rpc-port) within {wait_s:g} s (--distributed-timeout).")))

    def shutdown(self, timeout: float = SHUTDOWN_GRACE_S) -> None:
        """Shutdown to its engine process, then wait up to ``timeout`` s for the connection to end."""
        with self._lock:
            self._stopping = True
            attached = self._attached.is_set()
        if attached and not self._closed.is_set():
            self._outbox.put(Shutdown())
            if not self._closed.wait(timeout):
                logger.warning("Data parallel: replica %d on %s did not stop within %.0f s", self.index,
                               self.address, timeout)
        self._outbox.put(None)  # stops the sender thread
        if attached:
            self._requests.close()

    def wait_exit(self, timeout: float) -> int | None:
        return None  # its process is another node's; its end reads as the connection closing

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and self._attached.is_set() and not self._closed.is_set()

    # ----- transport ----------------------------------------------------------------------
    def _read_forever(self) -> None:
        try:
            super()._read_forever()
        finally:
            self._closed.set()

    def _gone_message(self) -> str:
        return (f"The connection to its node {self.address} closed (its engine process there exited, or the node "
                f"or the network went away).")

    def _on_message(self, message: Any) -> None:
        if isinstance(message, EngineReady):
            self.pid = message.pid
        super()._on_message(message)
