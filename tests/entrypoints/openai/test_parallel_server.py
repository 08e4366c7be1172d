"""The OpenAI server over worker processes: a killed worker makes it exit naming the rank;
a two-"node" launch on 127.0.0.1 (node 0 serving, node 1 --headless) answers a request."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx

from conftest import free_port_pair
from remote_server import server_model, start_server  # noqa: F401 (fixtures)

COMPLETION = {"model": None, "prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def test_killed_worker_makes_the_server_exit_naming_the_rank(start_server):
    server = start_server("--tensor-parallel-size", "2").wait_ready()
    pid = int(re.search(r"rank 1 \(pid (\d+)\)", server.log()).group(1))
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    assert server.wait_exit(timeout=30) == 1
    assert time.monotonic() - started < 10
    assert re.search(rf"worker rank 1 \(pid {pid}\) exited with code -9", server.log())


def test_two_node_launch_on_loopback_serves_a_request(start_server):
    port = str(free_port_pair())  # the node link takes --master-port + 1
    common = ("--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port)
    head = start_server(*common, "--node-rank", "0")
    worker_node = start_server(*common, "--node-rank", "1", "--headless")
    head.wait_ready()
    assert "Headless node 1: ranks [1]" in worker_node.log()
    body = dict(COMPLETION, model=_served_name(head))
    response = httpx.post(head.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    head.stop()
    assert worker_node.wait_exit(timeout=30) == 0  # rank 0's shutdown message ends node 1's ranks


def _served_name(server) -> str:
    return httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
