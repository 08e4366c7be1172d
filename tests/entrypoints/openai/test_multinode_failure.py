"""A two-"node" launch on 127.0.0.1 (node 0 serving, node 1 --headless): when a rank of node 1
dies, or node 1's launcher itself, node 0's server exits 1 naming that rank or node (the node
link, --master-port + 1); a headless node with no node 0 to reach exits 1 naming the flags, and
one started with other parallel flags than node 0 is refused by both (exit 2)."""

from __future__ import annotations

import os
import re
import signal

from conftest import free_port_pair
from remote_server import server_model, start_server  # noqa: F401 (fixtures)


def _two_nodes(start_server):
    common = ("--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port_pair()))
    head = start_server(*common, "--node-rank", "0")
    node1 = start_server(*common, "--node-rank", "1", "--headless")
    head.wait_ready()
    return head, node1


def test_killed_rank_on_the_headless_node_makes_the_server_exit_naming_rank_and_node(start_server):
    head, node1 = _two_nodes(start_server)
    assert "node link: node 1 (rank 1) connected from 127.0.0.1" in head.log()
    pid = int(re.search(r"Headless node 1: ranks \[1\] \(pids \[(\d+)\]\)", node1.log()).group(1))
    os.kill(pid, signal.SIGKILL)
    assert head.wait_exit(timeout=60) == 1
    assert re.search(rf"worker rank 1 \(pid {pid}\) on node 1 exited with code -9", head.log()), head.log()
    assert node1.wait_exit(timeout=60) == 1
    assert f"worker rank 1 (pid {pid}) exited with code -9" in node1.log()


def test_killed_headless_launcher_makes_the_server_exit_naming_the_node(start_server):
    head, node1 = _two_nodes(start_server)
    os.kill(node1.proc.pid, signal.SIGKILL)  # the launcher; its rank exits with it
    assert head.wait_exit(timeout=60) == 1
    assert "node 1 (rank 1) lost its connection to the engine" in head.log(), head.log()


def test_headless_node_without_node_0_exits_naming_master_addr_and_port(start_server):
    port = str(free_port_pair())
    node1 = start_server("--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--headless",
                         "--master-addr", "127.0.0.1", "--master-port", port, "--distributed-timeout", "2")
    assert node1.wait_exit(timeout=60) == 1
    assert (f"node 1 could not reach node 0's engine at 127.0.0.1:{int(port) + 1} (--master-addr, and "
            f"--master-port {port} + 1 for the node link) within 2 s") in node1.log(), node1.log()


def test_headless_node_with_other_parallel_flags_is_refused_by_both_sides(start_server):
    port = str(free_port_pair())
    common = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port)
    head = start_server("--tensor-parallel-size", "2", *common, "--node-rank", "0")
    node1 = start_server("--tensor-parallel-size", "4", *common, "--node-rank", "1", "--headless")
    assert node1.wait_exit(timeout=180) == 2
    assert head.wait_exit(timeout=180) == 2
    expected = "node 1 at 127.0.0.1 announced ranks [2, 3], but node 0 expects node 1: [1]: give every node the same"
    assert expected in head.log(), head.log()
    assert "node 0 refused this node: " + expected in node1.log(), node1.log()
