"""Load and fault test of the real server: N streaming clients for a while, some of them
leaving mid-stream on purpose, bad requests sprinkled in, then SIGTERM under a fresh load.

    python benchmarks/load_and_fault.py                       # 64 clients, 180 s, then 32 + SIGTERM
    python benchmarks/load_and_fault.py --clients 8 --duration 20 --sigterm-clients 8

Phase 1 (load): each client loops over /v1/chat/completions and /v1/completions streams
(max_tokens 8-128, some n=2, ~10% closed after a few chunks); another task sends bad requests
(lone surrogates, n over --max-n, 10 MB bodies, ...), each of which must get a 4xx. A thread
polls /health every 0.2 s and the server's RSS. After the load, /metrics must show no request
running or waiting and no KV block in use. --rounds N repeats phase 1 on the same server: RSS
after each round tells memory the allocator keeps (flat from round 2) from a leak (grows).
Phase 2 (SIGTERM): a fresh load, SIGTERM after a few seconds. Every stream that got its 200
must end with `data: [DONE]` and finish reasons stop/length; requests sent after /health
turned 503 must get 503 or a refused connection; the process must exit 0 within
--shutdown-timeout + --exit-margin.

Prints markdown tables; exits 1 if an invariant fails. Latencies are reported, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from load_and_fault_report import invariants, load_rows, print_table, sigterm_rows

TOPICS = ("the sea", "a lighthouse keeper", "prime numbers", "bread", "a lost key", "winter", "rivers",
          "a robot learning to paint", "the moon", "an old map")
CLEAN_FINISH = ("stop", "length")
STREAM_TIMEOUT = httpx.Timeout(connect=10.0, read=300.0, write=60.0, pool=None)

# ---------------------------------------------------------------- the server process


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: str
    model: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "tengyun.entrypoints.openai.api_server", *([args.model] if args.model else []),
           "--host", "127.0.0.1", "--port", str(port), "--kv-cache-memory", args.kv_cache_memory,
           "--shutdown-timeout", str(args.shutdown_timeout), "--disable-uvicorn-access-log"]
    log_path = os.path.join(tempfile.gettempdir(), f"tengyun-load-and-fault-{port}.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    print(f"server pid {proc.pid}: {' '.join(cmd)}\nserver log: {log_path}", flush=True)
    return Server(proc, f"http://127.0.0.1:{port}", log_path)


def wait_healthy(server: Server, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            sys.exit(f"server exited with {server.proc.returncode} before /health 200; see {server.log_path}")
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                server.model = httpx.get(f"{server.url}/v1/models", timeout=5).json()["data"][0]["id"]
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    server.proc.kill()
    sys.exit(f"server not healthy after {timeout_s:.0f} s; see {server.log_path}")


def rss_mib(pid: int, field_name: str = "VmRSS") -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) / 1024  # "VmRSS:  123456 kB"
    except FileNotFoundError:
        return None
    return None


def cpu_seconds(pid: int) -> tuple[float, float, float]:
    """Busy CPU seconds so far: (the whole machine, the server process, this load generator)."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        jiffies = [int(x) for x in f.readline().split()[1:]]  # user nice system idle iowait irq softirq steal ...
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read().rsplit(")", 1)[1].split()  # after "(comm)": state [0], utime [11], stime [12]
    own = os.times()
    return ((sum(jiffies[:3]) + sum(jiffies[5:8])) / tick, (int(stat[11]) + int(stat[12])) / tick,
            own.user + own.system)


# ---------------------------------------------------------------- /health and RSS, in a thread


@dataclass
class HealthWatch:
    """Polls /health every 0.2 s from its own thread (so the load's event loop cannot delay it)."""
    url: str
    pid: int
    latencies: list[float] = field(default_factory=list)
    not_ok_before_sigterm: Counter = field(default_factory=Counter)
    after_sigterm: Counter = field(default_factory=Counter)
    rss_peak: float = 0.0
    sigterm_at: float | None = None  # time.monotonic() when SIGTERM was sent
    draining_seen_at: float | None = None  # first /health 503 after SIGTERM
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(timeout=10.0) as client:
            while not self.stop.wait(0.2):
                self.rss_peak = max(self.rss_peak, rss_mib(self.pid) or 0.0)
                self.poll(client)

    def poll(self, client: httpx.Client) -> None:
        start = time.monotonic()
        try:
            status = str(client.get(f"{self.url}/health").status_code)
            if self.sigterm_at is None:
                self.latencies.append(time.monotonic() - start)
        except httpx.TransportError as e:
            status = type(e).__name__
        if self.sigterm_at is None and status != "200":
            self.not_ok_before_sigterm[status] += 1
        elif self.sigterm_at is not None:
            self.after_sigterm[status] += 1
        if self.sigterm_at is not None and self.draining_seen_at is None and status == "503":
            self.draining_seen_at = time.monotonic()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, daemon=True, name="health-watch")
        thread.start()
        return thread


# ---------------------------------------------------------------- streaming clients


@dataclass
class Tally:
    completed: int = 0
    disconnected: int = 0  # closed on purpose after a few chunks
    refused: Counter = field(default_factory=Counter)  # phase 2: "503" / "ConnectError" after SIGTERM
    failed: Counter = field(default_factory=Counter)  # reason -> count
    statuses: Counter = field(default_factory=Counter)
    finish: Counter = field(default_factory=Counter)
    accepted_after_drain: int = 0  # 200s for requests sent after /health turned 503
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    output_tokens: int = 0


@dataclass
class Stream:
    """What one SSE response carried."""
    done: bool = False
    error: str | None = None
    chunks: int = 0
    first_token_at: float | None = None
    finish: dict[int, str] = field(default_factory=dict)  # choice index -> finish_reason
    completion_tokens: int = 0


def make_request(rng: random.Random, model: str, disconnect: bool) -> tuple[str, dict]:
    """A chat or completion stream; a request meant to be left early ignores EOS so it is long."""
    n = 2 if rng.random() < 0.2 else 1
    max_tokens = rng.randint(32, 128) if disconnect else rng.randint(8, 128)
    topic = f"{rng.choice(TOPICS)} ({rng.randint(0, 10**6)})"
    body = {"model": model, "max_tokens": max_tokens, "n": n, "stream": True, "ignore_eos": disconnect,
            "stream_options": {"include_usage": True}}
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"Tell me about {topic}."}]}
    return "/v1/completions", {**body, "prompt": f"A short note about {topic}:"}


def read_event(stream: Stream, payload: str, now: float) -> None:
    if payload == "[DONE]":
        stream.done = True
        return
    try:
        event = json.loads(payload)
    except json.JSONDecodeError:
        stream.error = f"malformed SSE event: {payload[:80]}"
        return
    if "error" in event:
        stream.error = f"stream error {event['error'].get('code')}: {event['error'].get('message', '')[:80]}"
        return
    stream.chunks += 1
    for choice in event.get("choices") or []:
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        if text and stream.first_token_at is None:
            stream.first_token_at = now
        if choice.get("finish_reason"):
            stream.finish[choice["index"]] = choice["finish_reason"]
    if event.get("usage"):
        stream.completion_tokens = event["usage"]["completion_tokens"]


async def one_request(client: httpx.AsyncClient, server: Server, rng: random.Random, tally: Tally,
                      watch: HealthWatch, disconnect_fraction: float) -> str:
    """Send one stream and tally it; returns "ok", or the refusal that ends a phase-2 client."""
    disconnect_after = rng.randint(1, 4) if rng.random() < disconnect_fraction else None
    path, body = make_request(rng, server.model, disconnect_after is not None)
    sent = time.monotonic()
    try:
        async with client.stream("POST", server.url + path, json=body, timeout=STREAM_TIMEOUT) as response:
            tally.statuses[response.status_code] += 1
            if response.status_code != 200:
                return await refused_or_failed(response, tally, watch)
            if watch.draining_seen_at is not None and sent > watch.draining_seen_at:
                tally.accepted_after_drain += 1
            stream = Stream()
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    read_event(stream, line[6:], time.monotonic())
                if disconnect_after is not None and stream.chunks >= disconnect_after and not stream.done:
                    tally.disconnected += 1
                    return "ok"  # leaving the `async with` closes the connection mid-stream
    except httpx.ConnectError:
        if watch.sigterm_at is None:
            tally.failed["ConnectError before SIGTERM"] += 1
            return "ok"
        tally.refused["ConnectError"] += 1
        return "refused"
    except httpx.TransportError as e:
        tally.failed[f"transport: {type(e).__name__}"] += 1
        return "ok"
    finish_stream(stream, body["n"], sent, tally)
    return "ok"


async def refused_or_failed(response: httpx.Response, tally: Tally, watch: HealthWatch) -> str:
    text = (await response.aread())[:120].decode(errors="replace")
    if response.status_code == 503 and watch.sigterm_at is not None:
        tally.refused["503"] += 1
        return "refused"
    tally.failed[f"status {response.status_code}: {text}"] += 1
    return "ok"


def finish_stream(stream: Stream, n: int, sent: float, tally: Tally) -> None:
    tally.finish.update(stream.finish.values())
    if stream.error or not stream.done:
        tally.failed[stream.error or "stream ended without [DONE]"] += 1
    elif len(stream.finish) != n or any(r not in CLEAN_FINISH for r in stream.finish.values()):
        tally.failed[f"finish reasons {sorted(stream.finish.values())} for n={n}"] += 1
    else:
        tally.completed += 1
        tally.output_tokens += stream.completion_tokens
        tally.e2e.append(time.monotonic() - sent)
        if stream.first_token_at is not None:
            tally.ttft.append(stream.first_token_at - sent)


async def client_loop(client, server, seed: int, tally: Tally, watch: HealthWatch, until: float | None,
                      disconnect_fraction: float) -> None:
    """Phase 1: requests until `until`. Phase 2 (until=None): until the server refuses one."""
    rng = random.Random(seed)
    while until is None or time.monotonic() < until:
        if await one_request(client, server, rng, tally, watch, disconnect_fraction) == "refused":
            return


# ---------------------------------------------------------------- bad requests: 4xx, never 5xx


def bad_requests(model: str) -> list[tuple[str, str, dict]]:
    """(name, path, httpx keyword arguments). Bodies are raw bytes where JSON cannot say it."""
    big = b'{"model": "%s", "prompt": "' % model.encode() + b"x" * 10_000_000 + b'", "max_tokens": 2}'

    async def chunked():
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]

    raw = {"headers": {"content-type": "application/json"}}
    chat = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    return [
        ("lone surrogate in prompt", "/v1/completions",
         {"content": b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}' % model.encode(), **raw}),
        ("lone surrogate in chat content", "/v1/chat/completions",
         {"content": b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}' % model.encode(),
          **raw}),
        ("n = 100000", "/v1/completions", {"json": {"model": model, "prompt": "hi", "n": 100_000, "max_tokens": 1}}),
        ("10 MB body, Content-Length", "/v1/completions", {"content": big, **raw}),
        ("10 MB body, chunked", "/v1/completions", {"content": chunked(), **raw}),
        ("malformed JSON", "/v1/chat/completions", {"content": b'{"messages": [', **raw}),
        ("request chat_template", "/v1/chat/completions", {"json": {**chat, "chat_template": "{{ 'x' }}"}}),
        ("max_tokens = -1", "/v1/chat/completions", {"json": {**chat, "max_tokens": -1}}),
        ("unknown model", "/v1/chat/completions", {"json": {**chat, "model": "no-such-model"}}),
        ('"stream": "yes"', "/v1/chat/completions", {"json": {**chat, "stream": "yes"}}),
    ]


async def bad_request_loop(client: httpx.AsyncClient, server: Server, until: float, interval_s: float,
                           results: Counter) -> None:
    """results[(name, status)] += 1; status is the code, or the transport error's name."""
    i = 0
    while time.monotonic() < until:
        requests = bad_requests(server.model)  # afresh: the chunked body's generator runs once
        name, path, kwargs = requests[i % len(requests)]
        try:
            response = await client.post(server.url + path, timeout=60.0, **kwargs)
            results[(name, str(response.status_code))] += 1
        except httpx.TransportError as e:
            results[(name, type(e).__name__)] += 1
        i += 1
        await asyncio.sleep(interval_s)


# ---------------------------------------------------------------- /metrics after the load

GAUGES = ("tengyun:num_requests_running", "tengyun:num_requests_waiting", "tengyun:kv_cache_usage_perc")


def read_gauges(text: str) -> dict[str, float]:
    """`tengyun:num_requests_running{model_name="m"} 0.0` -> {"tengyun:num_requests_running": 0.0}"""
    values = {}
    for name in GAUGES:
        match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
        values[name] = float(match.group(1)) if match else float("nan")
    return values


def wait_metrics_idle(server: Server, timeout_s: float) -> tuple[dict[str, float], float]:
    """Polls /metrics until the three gauges are 0; returns the last values and the seconds waited."""
    start = time.monotonic()
    while True:
        values = read_gauges(httpx.get(f"{server.url}/metrics", timeout=10).text)
        if all(v == 0 for v in values.values()) or time.monotonic() - start > timeout_s:
            return values, time.monotonic() - start
        time.sleep(0.5)


# ---------------------------------------------------------------- the two phases


def client_pool(size: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=size, max_keepalive_connections=size))


@dataclass
class LoadRounds:
    """Phase 1, --rounds times on one server: one tally over all rounds, and per round its wall
    time, the /metrics gauges once idle, the seconds to get there and the RSS after."""
    rss_start: float
    tally: Tally = field(default_factory=Tally)
    bad: Counter = field(default_factory=Counter)  # (name, status) -> count
    walls: list[float] = field(default_factory=list)
    gauges: list[dict[str, float]] = field(default_factory=list)
    idle_s: list[float] = field(default_factory=list)
    rss_ends: list[float] = field(default_factory=list)
    cpu_cores: tuple[float, float, float] = (0.0, 0.0, 0.0)  # server, load generator, everything else

    def settle(self, server: Server, idle_timeout_s: float) -> None:
        gauges, idle_s = wait_metrics_idle(server, idle_timeout_s)
        self.gauges.append(gauges)
        self.idle_s.append(idle_s)
        self.rss_ends.append(rss_mib(server.proc.pid))


async def load_phase(args, server: Server, watch: HealthWatch, rounds: LoadRounds, round_index: int) -> None:
    start = time.monotonic()
    until = start + args.duration
    async with client_pool(args.clients) as client, client_pool(1) as bad_client:
        await asyncio.gather(
            *(client_loop(client, server, round_index * 1000 + i, rounds.tally, watch, until,
                          args.disconnect_fraction) for i in range(args.clients)),
            bad_request_loop(bad_client, server, until, args.bad_interval, rounds.bad))
    rounds.walls.append(time.monotonic() - start)


async def sigterm_phase(args, server: Server, watch: HealthWatch) -> tuple[Tally, int | None, float]:
    """Returns the tally, the exit code (None: killed after the limit) and seconds from SIGTERM to exit."""
    tally = Tally()
    async with client_pool(args.sigterm_clients) as client:
        tasks = [asyncio.create_task(client_loop(client, server, 10_000 + i, tally, watch, None,
                                                 args.disconnect_fraction))
                 for i in range(args.sigterm_clients)]
        await asyncio.sleep(args.sigterm_after)
        watch.sigterm_at = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(wait_exit, server.proc, args.shutdown_timeout + args.exit_margin)
        exit_s = time.monotonic() - watch.sigterm_at
        await asyncio.gather(*tasks)  # each client ends on a refusal (503, then connection refused)
    return tally, code, exit_s


def wait_exit(proc: subprocess.Popen, timeout_s: float) -> int | None:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--clients", type=int, default=64, help="streaming clients in phase 1")
    p.add_argument("--duration", type=float, default=180.0, help="seconds phase 1 starts new requests")
    p.add_argument("--rounds", type=int, default=1,
                   help="phase 1 this many times on one server (RSS after each: retained vs leaked memory)")
    p.add_argument("--disconnect-fraction", type=float, default=0.1, help="streams closed after 1-4 chunks")
    p.add_argument("--bad-interval", type=float, default=1.0, help="seconds between bad requests")
    p.add_argument("--idle-timeout", type=float, default=60.0, help="seconds /metrics may take to reach 0")
    p.add_argument("--sigterm-clients", type=int, default=32, help="streaming clients in phase 2")
    p.add_argument("--sigterm-after", type=float, default=5.0, help="seconds of phase-2 load before SIGTERM")
    p.add_argument("--shutdown-timeout", type=float, default=300.0,
                   help="the server's --shutdown-timeout: long enough for phase 2's streams to finish on 2 busy cores")
    p.add_argument("--exit-margin", type=float, default=30.0, help="seconds past --shutdown-timeout to exit")
    p.add_argument("--json", default=None, help="also write the tables' rows here")
    return p.parse_args(argv)


def run(args: argparse.Namespace, server: Server) -> int:
    wait_healthy(server)
    pid = server.proc.pid
    watch = HealthWatch(server.url, pid)
    rounds = LoadRounds(rss_start=rss_mib(pid))
    watch.start()
    cpu, start = cpu_seconds(pid), time.monotonic()
    for i in range(args.rounds):
        asyncio.run(load_phase(args, server, watch, rounds, i))
        rounds.settle(server, args.idle_timeout)
    used = [b - a for a, b in zip(cpu, cpu_seconds(pid))]
    rounds.cpu_cores = tuple(x / (time.monotonic() - start) for x in (used[1], used[2], used[0] - used[1] - used[2]))
    hwm = rss_mib(pid, "VmHWM")
    term, code, exit_s = asyncio.run(sigterm_phase(args, server, watch))
    watch.stop.set()
    log_errors = [line for line in open(server.log_path) if "Traceback" in line or " ERROR " in line]
    tables = {"Phase 1: load": load_rows(args, rounds, watch, hwm),
              "Phase 2: SIGTERM under load": sigterm_rows(args, term, code, exit_s, watch, log_errors)}
    for title, rows in tables.items():
        print_table(title, rows)
    broken = invariants(rounds, watch, term, code) + [f"server log: {line.strip()[:200]}" for line in log_errors[:5]]
    print("\n" + ("\n".join(f"FAILED: {b}" for b in broken) if broken else "All invariants held."))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**tables, "failed": broken}, f, indent=1)
    return 1 if broken else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = start_server(args)
    try:
        return run(args, server)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


if __name__ == "__main__":
    sys.exit(main())
