"""The node link: how --headless nodes tell node 0's engine that one of their ranks exited.

Plain TCP, one JSON object per line, no torch (the engine process imports this). Node 0's
engine listens on --master-port + 1 on every interface; each headless launcher connects
before it starts its ranks, then only reports:

    headless -> engine   {"hello": 1, "ranks": [2, 3]}
    engine -> headless   {"welcome": true}  or  {"welcome": false, "error": "..."}
    headless -> engine   {"joined": [2, 3]}                       (all its ranks reported ready)
    headless -> engine   {"exit": 3, "pid": 4242, "code": -9}     (each rank that exits)

The engine reads a report as RankExit, and a welcomed connection that closes while the
engine runs as NodeLost (the launcher or its whole host is gone, or the network broke).
A headless launcher that sees the link close knows node 0's engine is gone.

Node 0's API server asks the engine how the nodes stand (GET /health/detail), on a connection
of its own that never says hello:

    server -> engine     {"status": 1}
    engine -> server     {"nodes": [{"node": 1, "ranks": [2, 3], "state": "joined", "address": "10.0.0.2"}]}

A node's state, as the link saw it: "waiting" (never connected) -> "connected" (welcomed, its
ranks starting) -> "joined" -> "rank_exited" (with rank, pid, code) or "lost" (link closed).
"""

from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import dataclass
from typing import Callable

from tengyun.distributed.rank_info import node_ranks
from tengyun.distributed.tcp_keepalive import watch_peer

logger = logging.getLogger(__name__)

RETRY_INTERVAL_S = 1.0
MAX_LINE_BYTES = 65536  # a report is ~50 bytes; a peer sending more without a newline is not a node


def link_port(master_port: int) -> int:
    """The node link's port on node 0: --master-port + 1 (29500 -> 29501)."""
    if master_port >= 65535:
        raise ValueError(f"--master-port {master_port} leaves no port for the node link (--master-port + 1): "
                         f"use a lower one, e.g. 29500.")
    return master_port + 1


@dataclass(frozen=True)
class RankExit:
    node: int
    rank: int
    pid: int
    code: int


@dataclass(frozen=True)
class NodeLost:
    node: int
    ranks: tuple[int, ...]


def describe_ranks(ranks) -> str:
    """[3] -> "rank 3"; [2, 3] -> "ranks 2, 3"."""
    ranks = list(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


@dataclass
class NodeObserver:
    """What a headless launcher (run_headless) tells its own node's server, beside the link
    reports; this base ignores everything. ``stop_handle``: a Connection or fd that turns
    readable when the node should stop (SIGTERM), watched with the ranks."""

    stop_handle: object = None

    def linked(self) -> None: ...

    def rank_started(self, rank: int, pid: int) -> None: ...

    def rank_joined(self, rank: int, memory: dict | None = None) -> None: ...

    def rank_exited(self, rank: int, pid: int, code: int) -> None: ...


class _Peer:
    def __init__(self, sock: socket.socket, address: str):
        self.sock, self.address = sock, address
        self.buffer = b""
        self.node: int | None = None  # set by its hello


class NodeLinkServer:
    """Engine side, node 0: accepts the headless nodes' connections and reads their reports.
    ``handles()`` go into multiprocessing.connection.wait next to pipes and sentinels; pass a
    ready one to ``read()``."""

    def __init__(self, port: int, nnodes: int, world_size: int):
        self.expected = {n: list(node_ranks(world_size, nnodes, n)) for n in range(1, nnodes)}
        try:
            if socket.has_dualstack_ipv6():
                self._listener = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
            else:
                self._listener = socket.create_server(("", port))
        except OSError as e:
            raise ValueError(f"cannot listen on port {port} for the node link (--master-port + 1): {e}; "
                             f"choose a --master-port whose next port is free too, e.g. 29500.") from None
        self._listener.setblocking(False)
        self._peers: dict[socket.socket, _Peer] = {}
        self.nodes = {n: {"node": n, "ranks": r, "state": "waiting", "address": None} for n, r in self.expected.items()}

    def handles(self) -> list[socket.socket]:
        return [self._listener, *self._peers]

    def owns(self, handle) -> bool:
        return handle is self._listener or handle in self._peers

    def poll(self) -> list[RankExit | NodeLost]:
        """Reports already waiting, without blocking (for health checks while idle)."""
        from multiprocessing.connection import wait

        events = []
        for handle in wait(self.handles(), 0):
            events += self.read(handle)
        return events

    def read(self, handle: socket.socket) -> list[RankExit | NodeLost]:
        """Accept a connection, or read what one peer sent; raise ValueError for a node that
        announces ranks this engine does not expect (flags differ between the nodes)."""
        if handle is self._listener:
            try:
                sock, address = self._listener.accept()
            except BlockingIOError:
                return []
            sock.setblocking(True)
            watch_peer(sock)
            self._peers[sock] = _Peer(sock, address[0].removeprefix("::ffff:"))  # IPv4 on a dual-stack socket
            return []
        peer = self._peers.get(handle)
        if peer is None:  # dropped earlier in this round
            return []
        try:
            data = handle.recv(65536)
        except OSError:
            data = b""
        if not data:
            return self._drop(peer)
        peer.buffer += data
        *lines, peer.buffer = peer.buffer.split(b"\n")
        if len(peer.buffer) > MAX_LINE_BYTES:
            lines.append(peer.buffer)  # unparseable: drops the peer below
        events = []
        for line in lines:
            message = _parse(line)
            if message is None:
                logger.warning("node link: dropped %s, which sent something other than a node report", peer.address)
                return events + self._drop(peer, quietly=True)  # not a Tengyun node: nothing to name
            if "hello" in message:
                self._welcome(peer, message)
            elif "status" in message:
                self._send(peer, {"nodes": list(self.nodes.values())})
            elif "joined" in message and peer.node is not None:
                self.nodes[peer.node]["state"] = "joined"
            elif "exit" in message and peer.node is not None:
                event = RankExit(peer.node, message["exit"], message["pid"], message["code"])
                self.nodes[peer.node].update(state="rank_exited", rank=event.rank, pid=event.pid, code=event.code)
                events.append(event)
        return events

    def close(self) -> None:
        for sock in [self._listener, *self._peers]:
            sock.close()
        self._peers.clear()

    def _welcome(self, peer: _Peer, hello: dict) -> None:
        node, ranks = hello["hello"], hello["ranks"]
        taken = {p.node for p in self._peers.values()}
        error = None
        if node not in self.expected or ranks != self.expected[node]:
            want = ", ".join(f"node {n}: {r}" for n, r in self.expected.items())
            error = (f"node {node} at {peer.address} announced ranks {ranks}, but node 0 expects {want}: "
                     f"give every node the same --tensor-parallel-size, --pipeline-parallel-size and "
                     f"--nnodes, and each its own --node-rank.")
        elif node in taken:
            error = (f"node {node} connected twice (again from {peer.address}): give each --headless node "
                     f"its own --node-rank.")
        self._send(peer, {"welcome": error is None, "error": error})
        if error is not None:
            raise ValueError(error)
        peer.node = node
        self.nodes[node].update(state="connected", address=peer.address)
        logger.info("node link: node %d (%s) connected from %s", node, describe_ranks(ranks), peer.address)

    @staticmethod
    def _send(peer: _Peer, message: dict) -> None:
        try:
            peer.sock.sendall((json.dumps(message) + "\n").encode())
        except OSError:
            pass

    def _drop(self, peer: _Peer, quietly: bool = False) -> list[NodeLost]:
        self._peers.pop(peer.sock, None)
        peer.sock.close()
        if peer.node is None or quietly:
            return []  # never said hello (a port probe, a status query): not a node
        if self.nodes[peer.node]["state"] != "rank_exited":
            self.nodes[peer.node]["state"] = "lost"
        return [NodeLost(peer.node, tuple(self.expected[peer.node]))]


class NodeLinkClient:
    """Headless side: connect to node 0's engine (retrying while it starts), then report exits."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    @classmethod
    def connect(cls, addr: str, master_port: int, node: int, ranks: list[int], within_s: float,
                stop: Callable[[], bool] = lambda: False) -> NodeLinkClient | None:
        """Raise ConnectionError once ``within_s`` seconds pass without a welcome; ValueError
        when the engine refuses this node (its message says which flag differs); None once
        ``stop()`` turns true between attempts."""
        port = link_port(master_port)
        deadline = time.monotonic() + within_s
        hello = (json.dumps({"hello": node, "ranks": ranks}) + "\n").encode()
        while True:
            attempt_s = min(10.0, max(1.0, deadline - time.monotonic()))
            try:
                with socket.create_connection((addr, port), timeout=attempt_s) as sock:
                    sock.sendall(hello)
                    reply = _parse(_read_line(sock))
                    if reply is None or "welcome" not in reply:
                        raise ConnectionError(f"something other than a Tengyun engine answers on port {port}")
                    if not reply["welcome"]:
                        raise ValueError(f"node 0 refused this node: {reply.get('error')}")
                    sock.settimeout(5.0)  # reports are a few bytes; never block long on a dead peer
                    watch_peer(sock)
                    return cls(sock.dup())
            except OSError as e:
                last = e
            if stop():
                return None
            if time.monotonic() + RETRY_INTERVAL_S > deadline:
                raise ConnectionError(
                    f"node {node} could not reach node 0's engine at {addr}:{port} (--master-addr, and "
                    f"--master-port {master_port} + 1 for the node link) within {within_s:g} s "
                    f"(--distributed-timeout); last error: {last}. Start node 0 with the same --master-addr "
                    f"and --master-port, and let this host reach TCP ports {master_port} and {port} on it."
                )
            time.sleep(RETRY_INTERVAL_S)

    def report_joined(self, ranks: list[int]) -> None:
        self._report({"joined": ranks})

    def report_exit(self, rank: int, pid: int | None, code: int | None) -> None:
        self._report({"exit": rank, "pid": pid, "code": code})

    def engine_gone(self) -> bool:
        """Call when the socket is readable: True when node 0's engine closed the link (it never
        writes after its welcome)."""
        try:
            return not self.sock.recv(4096)
        except OSError:
            return True

    def _report(self, message: dict) -> None:
        """Best effort: once node 0's engine has gone (normal shutdown) nobody listens."""
        try:
            self.sock.sendall((json.dumps(message) + "\n").encode())
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


def query_nodes(addr: str, master_port: int, timeout_s: float) -> list[dict] | None:
    """The engine's view of every headless node (the "nodes" list above), or None when it does
    not answer within ``timeout_s`` (not listening yet, or gone)."""
    try:
        with socket.create_connection((addr, link_port(master_port)), timeout=timeout_s) as sock:
            sock.sendall(b'{"status": 1}\n')
            reply = _parse(_read_line(sock))
    except (OSError, ValueError):
        return None
    return reply["nodes"] if reply is not None and "nodes" in reply else None


def _parse(line: bytes) -> dict | None:
    """One message, or None for anything that is not one of the kinds above."""
    try:
        message = json.loads(line)
    except ValueError:
        return None
    kinds = ({"hello", "ranks"}, {"welcome", "error"}, {"exit", "pid", "code"}, {"joined"}, {"status"}, {"nodes"})
    if not isinstance(message, dict) or not any(k <= message.keys() for k in kinds):
        return None
    if "hello" in message and not (isinstance(message["hello"], int) and isinstance(message["ranks"], list)):
        return None
    return message


def _read_line(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("the connection closed before node 0's engine answered")
        data += chunk
    return data
