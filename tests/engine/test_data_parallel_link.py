"""The data-parallel link over real loopback sockets, no model: the API node reserves a headless
node's whole range at its first hello, so a node overlapping another is refused before any of its
replicas is attached; a range among the API node's own replicas is refused naming the flag; a
peer that is not a Tengyun node is dropped and the listener keeps serving; a headless node with no
API node to reach gives up after its timeout naming the flags."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest

from tengyun.engine.data_parallel_link import ReplicaListener, connect_replica

SPEC = SimpleNamespace(architecture="Qwen3MoeForCausalLM", num_layers=2, hidden_size=64, vocab_size=384,
                       quantization=None)


def _settings(port: int, start: int, local: int, dp: int = 6) -> SimpleNamespace:
    return SimpleNamespace(data_parallel_size=dp, data_parallel_size_local=local, data_parallel_start_rank=start,
                           data_parallel_address="127.0.0.1", data_parallel_rpc_port=port, tensor_parallel_size=1,
                           pipeline_parallel_size=1, enable_expert_parallel=False, model_spec=SPEC)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _attached(attached: dict, count: int) -> list[int]:
    """The attached replicas once ``count`` are (the listener attaches just after its welcome)."""
    deadline = time.monotonic() + 30
    while len(attached) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return sorted(attached)


@pytest.fixture
def api_node():
    """A listener for -dp 6 -dpl 2 (replicas 2..5 remote) -> (port, attached {replica: address})."""
    port = _free_port()
    listener = ReplicaListener(_settings(port, 0, 2))
    attached: dict[int, str] = {}
    connections = []

    def attach(replica: int, conn, address: str) -> bool:
        attached[replica] = address
        connections.append(conn)
        return True

    listener.start(attach)
    yield port, attached
    listener.close()
    for conn in connections:
        conn.close()


def test_an_overlapping_node_is_refused_before_any_of_its_replicas_attaches(api_node):
    port, attached = api_node
    a = [connect_replica(_settings(port, 3, 2), replica, "node-a", 10.0) for replica in (3, 4)]
    with pytest.raises(ValueError, match=r"asks for replicas 2..3 \(--data-parallel-start-rank 2, --data-parallel-"
                                         r"size-local 2\), but replica 3 is already served by the node at 127.0.0.1"):
        connect_replica(_settings(port, 2, 2), 2, "node-b", 10.0)
    with pytest.raises(ValueError, match=r"replicas 0..1 run on the API node \(its --data-parallel-size-local 2\): "
                                         r"start that node at --data-parallel-start-rank 2 or above"):
        connect_replica(_settings(port, 1, 1), 1, "node-c", 10.0)
    with pytest.raises(ValueError, match=r"runs --tensor-parallel-size 2, but the API node runs "
                                         r"--tensor-parallel-size 1"):
        connect_replica(SimpleNamespace(**{**vars(_settings(port, 5, 1)), "tensor_parallel_size": 2}), 5, "n", 10.0)
    assert _attached(attached, 2) == [3, 4]  # replica 2 stays free: node-b attached nothing
    c = connect_replica(_settings(port, 2, 1), 2, "node-d", 10.0)
    assert _attached(attached, 3) == [2, 3, 4]
    for conn in (*a, c):
        conn.close()


def test_a_peer_that_is_not_a_node_is_dropped_and_the_listener_keeps_serving(api_node):
    port, attached = api_node
    with socket.create_connection(("127.0.0.1", port), timeout=10) as probe:
        probe.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            answer = probe.recv(100)
        except ConnectionResetError:  # closed with the request unread
            answer = b""
        assert answer == b""  # closed without an answer
    conn = connect_replica(_settings(port, 2, 1), 2, "node-a", 10.0)
    assert _attached(attached, 1) == [2]
    conn.close()


def test_a_headless_node_with_no_api_node_gives_up_naming_the_flags():
    port = _free_port()
    with pytest.raises(ConnectionError, match=rf"data-parallel replica 2 could not reach the API node at "
                                              rf"127.0.0.1:{port} \(--data-parallel-address, --data-parallel-rpc-port\)"
                                              rf" within 1.5 s \(--distributed-timeout\)"):
        connect_replica(_settings(port, 2, 1), 2, "node-a", 1.5)


def test_a_taken_port_on_the_api_node_is_a_configuration_error_naming_the_flags(api_node):
    port, _ = api_node
    with pytest.raises(ValueError, match=rf"cannot listen on 127.0.0.1:{port} .*\(--data-parallel-address, "
                                         rf"--data-parallel-rpc-port\): .*give --data-parallel-address one of this "
                                         rf"node's own addresses and a free --data-parallel-rpc-port"):
        ReplicaListener(_settings(port, 0, 2))
