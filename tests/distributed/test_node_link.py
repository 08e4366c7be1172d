"""The node link over real loopback sockets: a headless node's hello, rank exits and a dropped
connection reach node 0's engine as RankExit / NodeLost; mismatched nodes are refused."""

from __future__ import annotations

import socket
import threading
import time
from multiprocessing.connection import wait

import pytest

from conftest import free_port_pair
from tengyun.executor.node_link import NodeLinkClient, NodeLinkServer, NodeLost, RankExit, link_port


def _connect_in_thread(port: int, node: int, ranks: list[int], within_s: float = 10.0) -> dict:
    result: dict = {}

    def run():
        try:
            result["client"] = NodeLinkClient.connect("127.0.0.1", port, node, ranks, within_s)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            result["error"] = e

    result["thread"] = threading.Thread(target=run, daemon=True)
    result["thread"].start()
    return result


def _serve_until(server: NodeLinkServer, done, timeout: float = 10.0) -> list:
    """Run the engine side's wait/read loop until ``done()``; the events it read."""
    events, deadline = [], time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        for handle in wait(server.handles(), 0.1):
            events += server.read(handle)
    return events


def test_rank_exit_then_dropped_connection_name_rank_and_node():
    port = free_port_pair()
    server = NodeLinkServer(link_port(port), nnodes=2, world_size=4)
    try:
        joined = _connect_in_thread(port, node=1, ranks=[2, 3])
        assert _serve_until(server, lambda: not joined["thread"].is_alive()) == []
        client = joined["client"]
        client.report_exit(3, 4242, -9)
        assert _serve_until(server, lambda: False, timeout=0.5) == [RankExit(node=1, rank=3, pid=4242, code=-9)]
        client.close()
        assert _serve_until(server, lambda: False, timeout=0.5) == [NodeLost(node=1, ranks=(2, 3))]
    finally:
        server.close()


def test_node_announcing_other_ranks_is_refused_naming_the_flags():
    port = free_port_pair()
    server = NodeLinkServer(link_port(port), nnodes=2, world_size=4)
    try:
        joined = _connect_in_thread(port, node=1, ranks=[1])  # node 1 thinks the world is 2 ranks
        with pytest.raises(ValueError, match=r"node 1 at 127.0.0.1 announced ranks \[1\], but node 0 expects "
                                             r"node 1: \[2, 3\]: give every node the same --tensor-parallel-size"):
            _serve_until(server, lambda: False)
        joined["thread"].join(10)
        assert isinstance(joined["error"], ValueError)
        assert "node 0 refused this node" in str(joined["error"])
    finally:
        server.close()


def test_a_port_probe_or_a_stray_client_is_not_a_node():
    port = free_port_pair()
    server = NodeLinkServer(link_port(port), nnodes=2, world_size=2)
    try:
        socket.create_connection(("127.0.0.1", link_port(port))).close()
        assert _serve_until(server, lambda: False, timeout=0.5) == []
        with socket.create_connection(("127.0.0.1", link_port(port))) as stray:
            stray.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert _serve_until(server, lambda: False, timeout=0.5) == []
            assert len(server.handles()) == 1  # dropped: only the listener is left
    finally:
        server.close()


def test_client_without_an_engine_gives_up_naming_addr_and_ports():
    port = free_port_pair()
    started = time.monotonic()
    with pytest.raises(ConnectionError) as error:
        NodeLinkClient.connect("127.0.0.1", port, node=1, ranks=[1], within_s=2)
    assert time.monotonic() - started < 30
    assert f"node 1 could not reach node 0's engine at 127.0.0.1:{port + 1} (--master-addr, and " \
           f"--master-port {port} + 1 for the node link) within 2 s" in str(error.value)


def test_link_port_refuses_the_last_port():
    assert link_port(29500) == 29501
    with pytest.raises(ValueError, match="--master-port 65535 leaves no port for the node link"):
        link_port(65535)
