"""A --headless data-parallel node is observable like a --headless rank node: the API node
`-dp 3 -dpl 1` runs replica 0, a headless node `-dp 3 -dpl 2 -dpr 1 --port P` runs replicas 1 and
2 and answers /health (200 once both are linked and loaded; 503 naming a SIGKILLed replica) and
/metrics (each replica's engine counters under engine="<its global index>", moving with the
requests the API node routes to it), and once a replica is killed exits 1 after the other one has
finished its request in flight. Under
`tengyun supervise` both nodes come back after a headless replica is killed and serve again, and
leave no process behind once stopped."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai

from cli_process import tengyun, wait_health  # noqa: F401 (fixture)
from conftest import free_port_pair
from remote_server import MAX_MODEL_LEN, RemoteServer, free_port, server_model  # noqa: F401 (fixtures)
from test_data_parallel_nodes import HeadlessNode, _link
from test_headless_node import _alive, _descendants
from test_data_parallel_server import _samples, _stream_long, _wait_for, _when


def _generated(samples: dict, engine: str) -> float:
    return sum(value for (name, labels), value in samples.items()
               if name == "vllm:generation_tokens_total" and dict(labels).get("engine") == engine)


def _value(samples: dict, name: str, engine: str) -> float | None:
    return next((value for (n, labels), value in samples.items() if n == name and dict(labels).get("engine") == engine),
                None)


def test_headless_data_parallel_node_answers_health_and_metrics_for_its_replicas(server_model, tmp_path):
    port = free_port_pair()
    head = RemoteServer(server_model, [*_link(3, port), "-dpl", "1"], tmp_path / "head.log")
    node = HeadlessNode(server_model, [*_link(3, port), "-dpl", "2", "-dpr", "1"], tmp_path / "node.log")
    try:
        waiting = _wait_for(lambda: _when(_get(node.url + "/health"), lambda r: r is not None), "the node's port")
        assert waiting.status_code == 503, waiting.text  # never 200 before its replicas are linked and loaded
        head.wait_ready()
        _wait_for(lambda: _when(_get(node.url + "/health"), lambda r: r is not None and r.status_code == 200),
                  f"the node's /health 200:\n{node.log()}")
        detail = httpx.get(node.url + "/health/detail", timeout=10).json()
        assert [(r["engine"], r["state"]) for r in detail["data_parallel"]] == [("1", "ready"), ("2", "ready")]
        assert httpx.get(node.url + "/v1/models", timeout=10).status_code == 404  # no API here

        before = _samples(node.url)
        assert _value(before, "tengyun:replica_alive", "1") == 1 and _value(before, "tengyun:replica_ready", "2") == 1
        assert _value(before, "vllm:generation_tokens_total", "0") is None  # replica 0 is the API node's
        assert any(name == "process_resident_memory_bytes" for name, _ in before)
        client = openai.OpenAI(base_url=head.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        for _ in range(3):  # one after another, equally idle replicas take turns: one request each
            done = client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0,
                                             extra_body={"ignore_eos": True})
            assert done.usage.completion_tokens == 5
        after = _wait_for(lambda: _when(_samples(node.url), lambda s: _generated(s, "2") > _generated(
            before, "2") and _generated(s, "1") > _generated(before, "1")), "replicas 1 and 2 counting tokens")
        assert (_generated(after, "1") - _generated(before, "1"), _generated(after, "2") - _generated(before, "2")) \
            == (5, 5)

        threads, results, owner = _one_long_request_per_replica(client, model, head.url)
        pid = detail["data_parallel"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        health = _wait_for(lambda: _when(_get(node.url + "/health"), lambda r: r is not None and r.status_code == 503),
                           "the node's /health 503 after replica 1 was killed")
        assert (f"data-parallel replica 1 (pid {pid}) on this node exited unexpectedly (killed by SIGKILL"
                in health.text), health.text
        for thread in threads:
            thread.join(timeout=300)
        # replica 2, on the node, finished its request before the node stopped it; replica 1's failed
        assert (results[owner[0]], results[owner[2]]) == ("length", "length"), (owner, results)
        assert isinstance(results[owner[1]], openai.APIError), (owner, results)
        assert node.wait_exit() == 1, node.log()
        assert "replica 1's engine process" in node.log() and head.wait_exit() == 1
    finally:
        node.stop()
        head.stop()


def _one_long_request_per_replica(client, model: str, head_url: str) -> tuple[list, dict, dict]:
    """Three streamed requests of 32 choices of LONG tokens, each started once the API node counts the
    ones before it in flight: the least loaded replica takes each, so every replica runs one ->
    (threads, thread index -> finish reason or error, replica index -> thread index). 32 choices: on
    the tiny model one choice of LONG tokens took ~0.6 s, and replica 1 once finished it before the
    third request was placed and the kill came (32 choices alone: ~3 s)."""
    results: dict[int, object] = {}

    def in_flight() -> dict[int, int]:
        detail = httpx.get(head_url + "/health/detail", timeout=10).json()["data_parallel"]
        return {int(r["engine"]): r["in_flight"] for r in detail}

    threads, owner = [], {}
    for i in range(3):
        threads.append(threading.Thread(target=_stream_long, args=(client, model, i, results, 32)))
        threads[-1].start()
        now = _wait_for(lambda n=i + 1: _when(in_flight(), lambda f: sum(f.values()) == n), f"{i + 1} in flight")
        owner[next(r for r, count in now.items() if count and r not in owner)] = i
    return threads, results, owner


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5)
    except httpx.TransportError:
        return None


def test_supervised_data_parallel_nodes_restart_after_a_headless_replica_dies_and_serve_again(tengyun, server_model):
    flags = [*_link(2, free_port_pair()), "-dpl", "1", "--kv-cache-memory", "64MiB", "--max-model-len",
             str(MAX_MODEL_LEN), "--disable-uvicorn-access-log", "--disable-log-stats", "--host", "127.0.0.1"]
    ports = free_port(), free_port()
    watch = ["--check-interval", "0.5", "--backoff-initial", "0.5"]
    head = tengyun("supervise", *watch, "--", "serve", str(server_model), *flags, "--port", str(ports[0]))
    node = tengyun("supervise", *watch, "--", "serve", str(server_model), *flags, "--headless", "-dpr", "1",
                   "--port", str(ports[1]))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    for url in urls:
        wait_health(url)
    pid = httpx.get(urls[1] + "/health/detail", timeout=10).json()["data_parallel"][0]["pid"]
    seen = _descendants(head.proc.pid) | _descendants(node.proc.pid)
    os.kill(pid, signal.SIGKILL)
    node.wait_log(r"Restart 1 \((exit|health)\)")  # its /health 503 naming the replica, then its exit 1
    head.wait_log(r"Restart 1 \((exit|health)\)")  # the API node lost replica 1: 503, exit 1
    for url in urls:
        wait_health(url, timeout=240)
    assert httpx.get(urls[1] + "/health/detail", timeout=10).json()["data_parallel"][0]["pid"] != pid
    for _ in range(2):  # one request per replica
        completion = httpx.post(urls[0] + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
        assert completion.status_code == 200, completion.text
    seen |= _descendants(head.proc.pid) | _descendants(node.proc.pid)
    assert head.stop() == 0  # the API node drains and says Shutdown to replica 1 too: its node exits 0
    node.wait_log(r"Restart 2 \(exit\): the server exited with code 0")  # restarted: waits for an API node again
    node.wait_log(r"Headless data-parallel node \(replica 1\): /health and /metrics on", count=3)  # SIGTERM handled
    assert node.stop() == 0
    assert "exited unexpectedly (killed by SIGKILL" in node.log()
    deadline = time.monotonic() + 10
    while _alive(seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(seen), f"left behind: {_alive(seen)}"
