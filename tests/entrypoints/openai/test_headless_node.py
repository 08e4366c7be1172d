"""A two-node cluster on 127.0.0.1 (node 0 serving, node 1 --headless, real processes, gloo):
the headless node answers /health and /metrics on its --port under the same --api-key rules as
node 0, node 0's /health/detail lists node 1 as the node link sees it, a real Prometheus
(Debian's) scrapes both with `tengyun deploy prometheus`'s config, and a killed headless rank
turns both nodes' /health to 503 naming it; under `tengyun supervise` both nodes come back and
serve again, leaving no process behind once stopped."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cli_process import tengyun, wait_health  # noqa: F401 (fixture)
from conftest import free_port_pair
from remote_server import MAX_MODEL_LEN, free_port, server_model, start_server  # noqa: F401 (fixtures)

KEY = "sk-two-nodes"
PROMETHEUS = shutil.which("prometheus")


def _cluster_flags(port: int) -> tuple[str, ...]:
    return ("--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
            "--device-metrics-interval", "0.5")


def _wait_status(url: str, status: int, timeout: float = 60.0, contains: str = "") -> httpx.Response:
    """Poll ``url`` until it answers ``status`` with ``contains`` in the body."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(url, timeout=5)
            if last.status_code == status and contains in last.text:
                return last
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    pytest.fail(f"{url} did not answer {status} with {contains!r} within {timeout} s; last: "
                f"{last.status_code if last else None} {last.text if last else ''}")


def _prometheus_query(url: str, query: str) -> list[dict]:
    answer = httpx.get(url + "/api/v1/query", params={"query": query}, timeout=10).json()
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def _start_prometheus(tmp_path: Path, targets: list[str]) -> tuple[subprocess.Popen, str]:
    for name, args in (("tengyun-alerts.yml", ["alerts"]),
                       ("prometheus.yml", ["prometheus", "--targets", ",".join(targets), "--scrape-interval", "1s"])):
        with open(tmp_path / name, "w") as out:
            code = subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "deploy", *args],
                                  stdout=out, timeout=120).returncode
        assert code == 0
    port = free_port()
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=open(tmp_path / "prometheus.log", "wb"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed: apt-get install prometheus")
def test_headless_node_is_observable_and_a_killed_rank_turns_both_nodes_503(start_server, tmp_path):
    flags = _cluster_flags(free_port_pair())
    head = start_server(*flags, "--node-rank", "0", "--api-key", KEY)
    node1 = start_server(*flags, "--node-rank", "1", "--headless", "--api-key", KEY)
    node1.wait_ready()
    head.wait_ready()

    # The same key rules as node 0: /health and /metrics open, anything else needs the key.
    assert httpx.get(node1.url + "/v1/models", timeout=10).status_code == 401
    refused = httpx.get(node1.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert refused.status_code == 404 and "send API requests to node 0" in refused.text
    detail = httpx.get(node1.url + "/health/detail", timeout=10).json()
    pid = detail["ranks"][0]["pid"]
    memory = detail["ranks"][0]["memory"]  # its MemoryReport: measured by its profile step
    assert detail["ranks"] == [{"rank": 1, "pid": pid, "state": "joined", "exit_code": None, "memory": memory}]
    assert memory["rank"] == 1 and memory["weights"] > 0 and memory["activation_peak"] > 0 and memory["kv_cache"] > 0
    assert detail["node_rank"] == 1 and detail["devices"]
    metrics = _wait_status(node1.url + "/metrics", 200, contains="tengyun:device_memory_used_bytes").text
    assert re.search(r'tengyun:rank_alive\{node="[^"]+",node_rank="1",rank="1"\} 1\.0', metrics), metrics
    assert "tengyun:server_ready 1.0" in metrics
    joined = _wait_status(head.url + "/health/detail", 200, contains='"state":"joined"')  # node 1's report may trail
    assert joined.json()["nodes"] == [{"node": 1, "ranks": [1], "state": "joined", "address": "127.0.0.1"}]

    prometheus, prom_url = _start_prometheus(tmp_path, [f"127.0.0.1:{head.port}", f"127.0.0.1:{node1.port}"])
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                up = {r["metric"]["instance"]: r["value"][1] for r in _prometheus_query(prom_url, "up")}
                alive = _prometheus_query(prom_url, 'tengyun:rank_alive{node_rank="1"}')
                memory = _prometheus_query(prom_url, "tengyun:device_memory_used_bytes")
            except (httpx.TransportError, ValueError):  # not listening yet, or "Service Unavailable" while it starts
                up, alive, memory = {}, [], []
            if len(up) == 2 and set(up.values()) == {"1"} and alive and \
                    {m["metric"]["instance"] for m in memory} == set(up):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"Prometheus did not scrape both nodes: up={up} alive={alive}\n"
                        f"{(tmp_path / 'prometheus.log').read_text()}")
    finally:
        prometheus.terminate()
        prometheus.wait(30)

    os.kill(pid, signal.SIGKILL)
    named = rf"worker rank 1 (pid {pid}) on node 1 exited with code -9"
    assert named in _wait_status(node1.url + "/health", 503, contains=f"pid {pid}").json()["error"]["message"]
    assert named in _wait_status(head.url + "/health", 503, contains=f"pid {pid}").json()["error"]["message"]
    assert node1.wait_exit(60) == 1
    assert head.wait_exit(60) == 1


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc), now."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def test_supervised_nodes_restart_after_a_headless_rank_dies_and_serve_again(tengyun, server_model):
    flags = [*_cluster_flags(free_port_pair()), "--kv-cache-memory", "64MiB", "--max-model-len", str(MAX_MODEL_LEN),
             "--disable-uvicorn-access-log", "--disable-log-stats", "--host", "127.0.0.1"]
    ports = free_port(), free_port()
    watch = ["--check-interval", "0.5", "--backoff-initial", "0.5"]
    head = tengyun("supervise", *watch, "--", "serve", str(server_model), *flags, "--node-rank", "0",
                   "--port", str(ports[0]))
    node1 = tengyun("supervise", *watch, "--", "serve", str(server_model), *flags, "--node-rank", "1", "--headless",
                    "--port", str(ports[1]))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    for url in urls:
        wait_health(url)
    node1.wait_log("The server is healthy")
    pid = httpx.get(urls[1] + "/health/detail", timeout=10).json()["ranks"][0]["pid"]
    seen = _descendants(head.proc.pid) | _descendants(node1.proc.pid)
    os.kill(pid, signal.SIGKILL)
    _wait_status(urls[1] + "/health", 503, contains=f"pid {pid}")
    node1.wait_log(r"Restart 1 \((exit|health)\)")  # its /health 503, or its exit 1
    head.wait_log(r"Restart 1 \((exit|health)\)")
    for url in urls:
        wait_health(url, timeout=240)
    new_pid = httpx.get(urls[1] + "/health/detail", timeout=10).json()["ranks"][0]["pid"]
    assert new_pid != pid
    completion = httpx.post(urls[0] + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
    assert completion.status_code == 200, completion.text
    seen |= _descendants(head.proc.pid) | _descendants(node1.proc.pid)
    assert head.stop() == 0  # node 0 drains; its engine's shutdown ends node 1's ranks
    node1.wait_log(r"Restart 2 \(exit\): the server exited with code 0")  # restarted: waits for a node 0 again
    node1.wait_log(r"Headless node 1: /health and /metrics on", count=3)  # its SIGTERM handler is in place
    assert node1.stop() == 0
    deadline = time.monotonic() + 10
    while _alive(seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(seen), f"left behind: {_alive(seen)}"
