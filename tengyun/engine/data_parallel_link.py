"""The data-parallel link: replicas on --headless nodes joining the API node's DataParallelClient
(vLLM's multi-node data parallel: `-dp 4 -dpl 2 -dpa HEAD -dpp PORT` on the API node,
`--headless -dp 4 -dpl 2 -dpr 2 -dpa HEAD -dpp PORT` on another).

    headless node                                        API node
    connect_replica(2) ---- TCP to HEAD:PORT ---->       ReplicaListener (one thread per connection)
        hello  {"replica": 2, "replicas": [2, 3], ...}   checked against this node's flags (refusal)
        answer {"welcome": true} | {"welcome": false, "error": "..."}
    engine process of replica 2  <== the engine-process protocol ==>  RemoteReplica 2

One connection per remote replica. It carries exactly what engine_process.py's two pipes carry
(AddRequest / AbortRequest / StartWave / Shutdown one way; EngineReady, StepResult, EngineDead the
other), both ways on one socket: multiprocessing's Connection over the socket (4-byte length, then
the bytes). The hello and its answer are JSON bytes, so nothing from an unchecked peer is
unpickled; after the welcome the messages are pickled, as over the pipes: like --master-port,
the port must be reachable from the cluster's nodes only.

Invariants:
- A node's whole range is reserved at its first hello: a node whose range overlaps another's is
  refused before it starts any replica, so a half-accepted node never leaves a replica
  attached and then closed.
- The connection ends only when a side is gone: the engine process exiting (killed, or told
  Shutdown), the API process exiting, or the network cut (TCP keepalive and a user timeout make a
  silent peer read as closed within seconds: distributed/tcp_keepalive.py). Either side then reads
  end of file: the API node names the replica dead, the engine process reads Shutdown.
Pure Python: no torch import.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

from tengyun.distributed.tcp_keepalive import watch_peer
from tengyun.sizing.data_parallel import local_replicas, rpc_port

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0  # a connection that says nothing for this long is not a replica
MAX_HELLO_BYTES = 4096  # a hello is ~200 bytes; a length header above this is not one
RETRY_INTERVAL_S = 1.0
LAYOUT_FLAGS = {"data_parallel_size": "--data-parallel-size", "tensor_parallel_size": "--tensor-parallel-size",
                "pipeline_parallel_size": "--pipeline-parallel-size",
                "enable_expert_parallel": "--enable-expert-parallel"}  # equal on every node


def describe_replicas(indexes: range) -> str:
    """range(1, 2) -> "replica 1"; range(2, 4) -> "replicas 2..3"."""
    return f"replica {indexes[0]}" if len(indexes) == 1 else f"replicas {indexes[0]}..{indexes[-1]}"


def hello(settings: Any, replica: int, node: str) -> dict:
    """What a --headless node says for one of its replicas: which, its whole range, its layout and model."""
    return {"replica": replica, "replicas": list(local_replicas(settings)), "node": node,
            "model": model_fingerprint(settings), **{key: getattr(settings, key) for key in LAYOUT_FLAGS}}


def model_fingerprint(settings: Any) -> dict:
    """The served model's shape as config.json gives it (ModelSpec, not the folder's path, which may
    differ between nodes): a digest to compare and a summary to show."""
    spec = settings.model_spec
    summary = (f"{spec.architecture}, {spec.num_layers} layers, hidden size {spec.hidden_size}, vocabulary "
               f"{spec.vocab_size}{f', {spec.quantization}' if spec.quantization else ''}")
    return {"digest": hashlib.sha256(repr(spec).encode()).hexdigest()[:16], "summary": summary}


class ReplicaListener:
    """API node: listens on --data-parallel-address (all interfaces when unset) :
    --data-parallel-rpc-port, checks each hello, and hands a welcomed connection to
    ``attach(replica, connection, address)``. Bind in the constructor (a taken port fails at
    start-up, exit 2), serve from start()."""

    def __init__(self, settings: Any):
        self.settings = settings
        self.first_remote = len(local_replicas(settings))  # replicas 0..first_remote-1 run here
        self.port = rpc_port(settings)
        host = settings.data_parallel_address or ""
        try:
            self._listener = socket.create_server((host, self.port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host or '*'}:{self.port} for the other nodes' data-parallel "
                             f"replicas (--data-parallel-address, --data-parallel-rpc-port): {e}; give "
                             f"--data-parallel-address one of this node's own addresses and a free "
                             f"--data-parallel-rpc-port (the same on every node), e.g. 13345.") from None
        self._lock = threading.Lock()
        self._owners: dict[int, tuple[str, str]] = {}  # replica -> (node id, address) of the node serving it
        self._attached: set[int] = set()
        self._attach: Callable[[int, Connection, str], bool] | None = None

    def start(self, attach: Callable[[int, Connection, str], bool]) -> None:
        self._attach = attach
        threading.Thread(target=self._accept_forever, name="tengyun-dp-listen", daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _accept_forever(self) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except OSError:  # closed: the server is stopping
                return
            threading.Thread(target=self._serve_one, args=(sock, address[0]), daemon=True).start()

    def _serve_one(self, sock: socket.socket, address: str) -> None:
        watch_peer(sock)
        conn = Connection(sock.detach())
        try:
            if not conn.poll(HELLO_TIMEOUT_S):
                raise OSError("no hello")
            message = json.loads(conn.recv_bytes(MAX_HELLO_BYTES))
            if not isinstance(message, dict) or not isinstance(message.get("replicas"), list):
                raise OSError("not a hello")
        except (OSError, EOFError, ValueError):  # a port probe, or not a Tengyun node: nothing to name
            conn.close()
            return
        error = self.refusal(message, address)
        try:
            conn.send_bytes(json.dumps({"welcome": error is None, "error": error}).encode())
        except OSError:
            error = error or "gone"
        if error is not None:
            logger.warning("data parallel: refused a node: %s", error)
            conn.close()
        elif not self._attach(message["replica"], conn, address):
            conn.close()

    def refusal(self, hello: dict, address: str) -> str | None:
        """Why the node at ``address`` cannot serve hello["replica"], or None (then it is reserved
        with the node's whole range)."""
        for key, flag in LAYOUT_FLAGS.items():
            theirs, ours = hello.get(key), getattr(self.settings, key)
            if theirs != ours:
                return (f"the node at {address} runs {flag} {_shown(theirs)}, but the API node runs {flag} "
                        f"{_shown(ours)}: give every node the same {flag}.")
        theirs, ours = hello.get("model") or {}, model_fingerprint(self.settings)
        if theirs.get("digest") != ours["digest"]:
            return (f"the node at {address} serves another model ({theirs.get('summary')}) than the API node "
                    f"({ours['summary']}): give every node the same model (its folder may sit at another path).")
        wanted, replica, node = hello["replicas"], hello.get("replica"), hello.get("node")
        if not wanted or replica not in wanted:
            return f"the node at {address} sent a malformed hello: {hello!r}."
        span = (f"replicas {wanted[0]}..{wanted[-1]} (--data-parallel-start-rank {wanted[0]}, "
                f"--data-parallel-size-local {len(wanted)})")
        if wanted[0] < self.first_remote:
            return (f"the node at {address} asks for {span}, but replicas 0..{self.first_remote - 1} run on the API "
                    f"node (its --data-parallel-size-local {self.first_remote}): start that node at "
                    f"--data-parallel-start-rank {self.first_remote} or above.")
        with self._lock:
            for other in wanted:
                owner = self._owners.get(other)
                if owner is not None and owner[0] != node:
                    return (f"the node at {address} asks for {span}, but replica {other} is already served by the "
                            f"node at {owner[1]}: give each --headless node its own range of replicas "
                            f"(--data-parallel-start-rank, --data-parallel-size-local).")
            if replica in self._attached:
                return f"replica {replica} connected twice from the node at {address}."
            for other in wanted:
                self._owners[other] = (node, address)
            self._attached.add(replica)
        return None


def _answer(data: bytes) -> dict:
    try:
        answer = json.loads(data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or "welcome" not in answer:
        raise ConnectionError("something other than a Tengyun API node answers there")
    return answer


def _shown(value: Any) -> str:
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)


def connect_replica(settings: Any, replica: int, node: str, within_s: float,
                    stop: Callable[[], bool] = lambda: False) -> Connection | None:
    """Headless node: the welcomed connection for ``replica``, retrying while the API node starts.
    Raises ValueError when the API node refuses this node (its message names the flag),
    ConnectionError once ``within_s`` s pass without an answer; None once ``stop()`` turns true."""
    host, port = settings.data_parallel_address, rpc_port(settings)
    deadline = time.monotonic() + within_s
    payload = json.dumps(hello(settings, replica, node)).encode()
    while True:
        attempt_s = min(10.0, max(1.0, deadline - time.monotonic()))
        try:
            sock = socket.create_connection((host, port), timeout=attempt_s)
            watch_peer(sock)
            sock.settimeout(None)
            conn = Connection(sock.detach())
            try:
                conn.send_bytes(payload)
                # the answer may wait while the API node forks its own replicas: give up on this connection
                # only at the deadline (a retry would leave this hello queued there, to be welcomed unread)
                wait_s = max(1.0, deadline - time.monotonic())
                if not conn.poll(wait_s):
                    raise ConnectionError(f"no answer within {wait_s:g} s")
                answer = _answer(conn.recv_bytes(MAX_HELLO_BYTES))
            except BaseException:
                conn.close()
                raise
            if not answer.get("welcome"):
                conn.close()
                raise ValueError(f"the API node at {host}:{port} refused this node: {answer.get('error')}")
            return conn
        except (OSError, EOFError) as e:  # not listening yet, or something else answers there
            last = e
        if stop():
            return None
        if time.monotonic() + RETRY_INTERVAL_S > deadline:
            raise ConnectionError(
                f"data-parallel replica {replica} could not reach the API node at {host}:{port} "
                f"(--data-parallel-address, --data-parallel-rpc-port) within {within_s:g} s "
                f"(--distributed-timeout); last error: {last}. Start the API node with the same "
                f"--data-parallel-size, --data-parallel-address and --data-parallel-rpc-port, and let this host "
                f"reach TCP port {port} on it.")
        time.sleep(RETRY_INTERVAL_S)
