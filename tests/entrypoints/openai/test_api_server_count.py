"""`--api-server-count 2`: two API processes on one port in front of one engine process answer as
one server does (same greedy outputs as a one-process server, through the openai SDK), both take
requests, /metrics on either counts every request once, a dead API process stops the server with
exit 1, SIGTERM drains both (here on a Unix socket they share) and leaves no process behind, and
what cannot run is refused (exit 2)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time

import httpx
import openai
import pytest

from remote_server import server_model, start_server  # noqa: F401 (fixtures)
from test_server_lifecycle import assert_error

PROMPTS = [f"def f{i}(x): return x + {i}" for i in range(16)]
MAX_TOKENS = 8
# counters the two servers must agree on exactly, for the same requests (warm-up excluded)
COUNTERS = ("tengyun:request_success_total", "tengyun:prompt_tokens_total", "tengyun:generation_tokens_total",
            "tengyun:e2e_request_latency_seconds_count", "tengyun:time_to_first_token_seconds_count",
            "vllm:request_success_total", "vllm:generation_tokens_total")


async def _answers(url: str) -> tuple[list[str], set[str]]:
    """Each prompt's greedy completion, asked concurrently, half of them streamed; and the
    x-tengyun-api-server values the answers carried."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

    async def plain(prompt: str) -> tuple[str, str | None]:
        raw = await client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                                temperature=0, extra_body={"ignore_eos": True})
        return raw.parse().choices[0].text, raw.headers.get("x-tengyun-api-server")

    async def streamed(prompt: str) -> tuple[str, str | None]:
        raw = await client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                                temperature=0, stream=True,
                                                                extra_body={"ignore_eos": True})
        text = "".join([chunk.choices[0].text async for chunk in raw.parse() if chunk.choices])
        return text, raw.headers.get("x-tengyun-api-server")

    results = await asyncio.gather(*(plain(p) if i % 2 else streamed(p) for i, p in enumerate(PROMPTS)))
    await client.close()
    return [text for text, _ in results], {server for _, server in results if server is not None}


def _counters(text: str) -> dict[str, float]:
    """{sample line's name and labels: value} for COUNTERS; no series may appear twice."""
    samples = re.findall(r"^(\S+) (\S+)$", text, re.M)
    picked = [(name, float(value)) for name, value in samples if name.split("{")[0] in COUNTERS]
    assert len({name for name, _ in picked}) == len(picked), "a series appears twice"
    return dict(picked)


def _metrics_from_each(url: str, settled) -> dict[str, str]:
    """/metrics as each API process answers it, {x-tengyun-api-server: text}, once ``settled(text)``:
    process 0 records a request process 1 answered when its own copy of the step arrives, which
    may be a moment after the client got the answer."""
    seen: dict[str, str] = {}
    for _ in range(600):
        r = httpx.get(url + "/metrics", timeout=30)  # a new connection, which the kernel gives to either process
        if settled(r.text):
            seen[r.headers["x-tengyun-api-server"]] = r.text
            if len(seen) == 2:
                break
        time.sleep(0.05)
    return seen


def _pids(log: str) -> tuple[list[int], int]:
    """(the API processes' pids, the engine's) as the supervisor logged them."""
    match = re.search(r"API server processes \(pids ([\d, ]+)\) on .+ in front of engine process (\d+)", log)
    return [int(p) for p in match.group(1).split(", ")], int(match.group(2))


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


MODEL = "tiny"


def test_two_api_processes_answer_as_one_count_each_request_once_and_stop_when_one_dies(start_server):  # noqa: F811
    single = start_server("--served-model-name", MODEL)
    pool = start_server("--served-model-name", MODEL, "--api-server-count", "2")
    single.wait_ready(), pool.wait_ready()
    expected, _ = asyncio.run(_answers(single.url))
    answers, servers = asyncio.run(_answers(pool.url))
    assert answers == expected
    assert servers == {"0", "1"}  # 16 connections at once: the kernel gave both processes some
    reference = _counters(httpx.get(single.url + "/metrics", timeout=30).text)
    assert reference['tengyun:request_success_total{finished_reason="length",model_name="tiny"}'] == len(PROMPTS)
    scraped = _metrics_from_each(pool.url, lambda text: _counters(text) == reference)
    assert set(scraped) == {"0", "1"}
    for text in scraped.values():
        assert re.findall(r"^tengyun:server_ready(\S*) (\S+)$", text, re.M) == [("", "1.0")]
        assert re.search(r"^tengyun_engine_process_resident_memory_bytes \d", text, re.M)
    api_pids, engine_pid = _pids(pool.log())
    os.kill(api_pids[1], signal.SIGKILL)
    assert pool.wait_exit() == 1
    assert f"API server process tengyun-api-1 (pid {api_pids[1]}) exited (code -9)" in pool.log()
    assert all(_gone(pid) for pid in (*api_pids, engine_pid))


def test_sigterm_drains_every_api_process_on_a_unix_socket_and_leaves_no_process_behind(start_server,  # noqa: F811
                                                                                          tmp_path):
    path = tmp_path / "tengyun.sock"
    with socket.socket(socket.AF_UNIX) as stale:  # a socket file an earlier server left behind
        stale.bind(str(path))
    pool = start_server("--api-server-count", "2", "--shutdown-timeout", "600", "--uds", str(path))
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://tengyun", timeout=300)
    for _ in range(2400):  # the server loads, then the two processes turn ready together
        try:
            if client.get("/health").status_code == 200:
                break
        except httpx.TransportError:  # the stale socket, not yet replaced
            pass
        assert pool.proc.poll() is None, pool.log()
        time.sleep(0.1)
    api_pids, engine_pid = _pids(pool.log())
    # 1,000 tokens: surely still running when the drain reaches the API processes (the supervisor
    # passes it on within WATCH_INTERVAL_S, each process takes it up at its next tick)
    body = {"prompt": PROMPTS[0], "max_tokens": 1000, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        next(lines)  # it is running
        pool.proc.send_signal(signal.SIGTERM)
        while client.get("/health").status_code != 503:
            time.sleep(0.05)
        for _ in range(4):  # whichever process takes it: shutting down
            assert_error(client.post("/v1/completions", json={"prompt": "x"}), 503, "shutting down")
        rest = list(lines)
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][len("data: "):])["usage"]["completion_tokens"] == 1000
    assert pool.wait_exit() == 0, pool.log()
    assert all(_gone(pid) for pid in (*api_pids, engine_pid))


@pytest.mark.parametrize("flags, env, words", [
    (["--disable-frontend-multiprocessing"], {}, "--disable-frontend-multiprocessing"),
    ([], {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}, "VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
    (["--data-parallel-size", "2"], {}, "--data-parallel-size"),  # not combined yet
])
def test_what_several_api_processes_cannot_serve_is_refused_with_exit_2(start_server, flags, env, words):  # noqa: F811
    server = start_server("-asc", "2", *flags, env=env)
    assert server.wait_exit() == 2
    assert words in server.log() and "--api-server-count" in server.log() and "Traceback" not in server.log()
