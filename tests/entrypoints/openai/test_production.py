"""Production operations end to end, with real servers and a real nginx on loopback:
`tengyun launch` (two instances behind the generated nginx config) and `tengyun supervise`
(graceful restart on a memory threshold, restart with back-off after an exit)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time

import httpx
import pytest

from cli_process import tengyun, wait_health  # noqa: F401 (fixture)
from conftest import free_port_pair
from remote_server import MAX_MODEL_LEN, free_port, server_model  # noqa: F401 (fixture)

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
SERVE_FLAGS = ["--kv-cache-memory", "64MiB", "--max-model-len", str(MAX_MODEL_LEN), "--disable-uvicorn-access-log",
               "--disable-log-stats"]

pytestmark = pytest.mark.skipif(not os.path.exists(NGINX), reason="nginx not installed (.ci/run installs it)")


def stream_completion(url: str, body: dict) -> tuple[list[dict], list[float], float]:
    """(chunks, arrival time of each, time the request was sent)."""
    sent = time.monotonic()
    chunks, arrivals = [], []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
                arrivals.append(time.monotonic())
    return chunks, arrivals, sent


def completion(url: str, prompt: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_two_instances_behind_nginx_stream_balance_and_survive_a_kill(server_model, tengyun, tmp_path):  # noqa: F811
    # Instance i listens on base + i. A kernel-chosen port is odd and base + 1 even, the parity
    # outgoing connections take, and a client's TIME_WAIT on it refuses the bind (CI lost instance
    # 1 so): both ports come from below the ephemeral range, checked free.
    base, listen = free_port_pair(), free_port()
    launch = tengyun("launch", "--instances", "2", "--base-port", str(base), "--listen", f"127.0.0.1:{listen}",
                     "--nginx-dir", str(tmp_path / "nginx"), "--nginx", NGINX,
                     "--", "serve", str(server_model), *SERVE_FLAGS)
    instances = [f"http://127.0.0.1:{base + i}" for i in range(2)]
    front = f"http://127.0.0.1:{listen}"
    for url in instances:
        wait_health(url, poll=0.2, log=launch.log)
    wait_health(front, log=launch.log)
    pids = {int(m.group(1)): int(m.group(2)) for m in launch.wait_log(r"Instance (\d): pid (\d+)", 2)}
    conf = (tmp_path / "nginx" / "nginx.conf").read_text()
    assert f"server 127.0.0.1:{base + 1} max_fails=1" in conf and "proxy_buffering off;" in conf

    # Streamed through nginx: the tokens arrive one by one, not in one burst at the end.
    chunks, arrivals, sent = stream_completion(front, {"prompt": "The quick brown fox", "max_tokens": 300,
                                                       "ignore_eos": True, "temperature": 0})
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and len(chunks) > 50
    assert arrivals[-1] - arrivals[0] > 0.5 * (arrivals[-1] - sent)
    # Not a few bursts: the chunks arrive at the engine's pace. The pace depends on the machine: on
    # an AMD EPYC VM a chunk came every 0.56-0.60 ms, and only 2-5 of 299 gaps passed the fixed 1 ms
    # this test once counted. So a gap counts when it is over a quarter of the stream's mean gap:
    # 243-279 of 299 did on that VM.
    # A proxy that holds the whole answer gives one such gap. nginx streams here even with
    # `proxy_buffering on` (254-261 gaps), since the server also sends `X-Accel-Buffering: no`;
    # the config line itself is checked above.
    mean_gap = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)
    assert sum(b - a > mean_gap / 4 for a, b in zip(arrivals, arrivals[1:])) >= len(arrivals) // 10
    assert "".join(c["choices"][0]["text"] for c in chunks) == completion_text(instances[0], 300)

    # Non-streamed answers through nginx equal the instances' own.
    prompts = ["Paris is the capital of", "def add(a, b):", "人工智能"]
    direct = [completion(instances[i % 2], p) for i, p in enumerate(prompts)]
    assert [completion(front, p) for p in prompts] == direct
    assert httpx.get(front + "/instances/1/health", timeout=10).status_code == 200
    assert "tengyun:num_requests_running" in httpx.get(front + "/instances/0/metrics", timeout=10).text

    # One instance dies: every request after that still succeeds, through the other.
    os.kill(pids[0], signal.SIGKILL)
    launch.wait_log(r"Instance 0 \(pid \d+\) exited")
    assert [completion(front, p) for p in prompts * 2] == direct * 2
    chunks, _, _ = stream_completion(front, {"prompt": "Hello", "max_tokens": 8, "temperature": 0})
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert httpx.get(front + "/instances/0/health", timeout=10).status_code == 502
    assert launch.stop() == 0, launch.log()


def completion_text(url: str, max_tokens: int) -> str:
    r = httpx.post(url + "/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": max_tokens,
                                                  "ignore_eos": True, "temperature": 0}, timeout=120)
    return r.json()["choices"][0]["text"]


def restarts_metric(metrics_url: str, reason: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    match = re.search(rf'^tengyun:supervisor_restarts_total{{reason="{reason}"}} (\S+)$', text, re.M)
    assert match, text
    return float(match.group(1))


def test_supervisor_memory_threshold_restarts_gracefully(server_model, tengyun):  # noqa: F811
    port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    sup = tengyun("supervise", "--memory-threshold", "0.001", "--check-interval", "1",
                  "--metrics-port", str(metrics_port), "--",
                  "serve", str(server_model), "--host", "127.0.0.1", "--port", str(port), "--shutdown-timeout",
                  "600", "--enforce-eager", *SERVE_FLAGS)
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    wait_health(url)
    sup.wait_log(r"The server is healthy")
    assert restarts_metric(metrics_url, "memory") == 0
    # The supervisor restarts one --check-interval after it logs the server healthy. The request
    # stays in flight through that however fast the engine is: the client stops reading after the
    # first chunk, so the server cannot send the last byte until the drain has begun; then the
    # client reads the rest. The answer must outgrow what the kernel holds for a client that does
    # not read: the server's send buffer (up to tcp_wmem's 4 MiB) and the client's receive buffer.
    # 2,000 tokens with 5 logprobs (~1 MB) did not: CI on a fast VM streamed them all before the
    # restart (finishing 0 in-flight requests). 8 choices with 20 logprobs are ~10.5 MB; on an AMD
    # EPYC VM the request was still in flight once the engine had finished them (4.7 s).
    body = {"prompt": "The quick brown fox", "max_tokens": 2000, "n": 8, "ignore_eos": True, "logprobs": 20,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        sup.wait_log(r"Restart 1 \(memory\): memory \S+% \(\d+ MiB of \d+ MiB\) >= --memory-threshold 0.001")
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks[-1]["usage"]["completion_tokens"] == 8 * 2000
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] \
        == ["length"] * 8
    assert "finishing 1 in-flight request(s)" in sup.log()  # the request above was mid-flight at the restart
    sup.wait_log(r"Started the server: pid \d+", 2)
    wait_health(url)
    assert restarts_metric(metrics_url, "memory") >= 1
    assert restarts_metric(metrics_url, "exit") == 0
    assert sup.stop() == 0, sup.log()


def test_supervisor_restarts_a_server_that_exits_with_backoff(server_model, tengyun):  # noqa: F811
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sup = tengyun("supervise", "--check-interval", "0.5", "--backoff-initial", "2", "--",
                  "serve", str(server_model), "--host", "127.0.0.1", "--port", str(port), *SERVE_FLAGS)
    for n in (1, 2):
        pid = int(sup.wait_log(r"Started the server: pid (\d+)", n)[-1].group(1))
        sup.wait_log(rf"The server is healthy \(pid {pid}\)")
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        sup.wait_log(rf"Restart {n} \(exit\): the server exited with code -9")
        sup.wait_log(r"Started the server: pid (\d+)", n + 1)
        if n == 2:  # the second restart in a row waits --backoff-initial
            assert time.monotonic() - killed >= 2.0
    assert re.findall(r"Starting the server again in (\S+) s", sup.log()) == ["0.0", "2.0"]
    wait_health(url)
    assert sup.stop() == 0, sup.log()
