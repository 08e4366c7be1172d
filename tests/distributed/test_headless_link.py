"""The node link's status query (what node 0's /health/detail shows) over real loopback sockets:
a node goes waiting -> connected -> joined -> rank_exited / lost as its launcher reports; a
query with no engine listening answers None; a headless launcher sees the engine close the link."""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import wait

from conftest import free_port_pair
from tengyun.executor.node_link import NodeLinkClient, NodeLinkServer, link_port, query_nodes


def _serving(server: NodeLinkServer) -> threading.Event:
    """The engine side's wait/read loop in a thread until the returned event is set."""
    stop = threading.Event()

    def run():
        while not stop.is_set():
            for handle in wait(server.handles(), 0.05):
                server.read(handle)

    threading.Thread(target=run, daemon=True).start()
    return stop


def _states(port: int) -> list[tuple[int, str]]:
    return [(n["node"], n["state"]) for n in query_nodes("127.0.0.1", port, timeout_s=5.0)]


def test_status_query_follows_a_node_from_waiting_to_joined_to_rank_exited():
    port = free_port_pair()
    server = NodeLinkServer(link_port(port), nnodes=3, world_size=3)
    stop = _serving(server)
    try:
        assert _states(port) == [(1, "waiting"), (2, "waiting")]
        client = NodeLinkClient.connect("127.0.0.1", port, 1, [1], within_s=10.0)
        assert _states(port) == [(1, "connected"), (2, "waiting")]
        assert query_nodes("127.0.0.1", port, 5.0)[0]["address"] == "127.0.0.1"
        client.report_joined([1])
        time.sleep(0.3)
        assert _states(port) == [(1, "joined"), (2, "waiting")]
        client.report_exit(1, 4242, -9)
        time.sleep(0.3)
        assert query_nodes("127.0.0.1", port, 5.0)[0] == {
            "node": 1, "ranks": [1], "state": "rank_exited", "address": "127.0.0.1", "rank": 1, "pid": 4242,
            "code": -9}
        other = NodeLinkClient.connect("127.0.0.1", port, 2, [2], within_s=10.0)
        other.close()
        time.sleep(0.3)
        assert _states(port)[1] == (2, "lost")
        client.close()
    finally:
        stop.set()
        server.close()


def test_status_query_without_an_engine_answers_none():
    assert query_nodes("127.0.0.1", free_port_pair(), timeout_s=1.0) is None


def test_headless_side_sees_the_engine_close_the_link():
    port = free_port_pair()
    server = NodeLinkServer(link_port(port), nnodes=2, world_size=2)
    stop = _serving(server)
    client = NodeLinkClient.connect("127.0.0.1", port, 1, [1], within_s=10.0)
    stop.set()
    time.sleep(0.2)
    server.close()
    assert wait([client.sock], 5.0) == [client.sock] and client.engine_gone()
    client.close()


def test_connect_gives_up_quietly_when_asked_to_stop():
    assert NodeLinkClient.connect("127.0.0.1", free_port_pair(), 1, [1], within_s=30.0, stop=lambda: True) is None
