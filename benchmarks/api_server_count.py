"""`--api-server-count 1` vs `2` side by side: 256 concurrent streams of 128 tokens (random 128-token
prompts, `tengyun bench serve`, all sent at once, --ignore-eos) against SmolLM2-135M-Instruct
(bfloat16). Prints output tok/s, TTFT, and the CPU seconds (utime + stime, /proc) the API
processes, the supervisor and the engine process spent during the run.

    .venv/bin/python benchmarks/api_server_count.py [--counts 1 2] [--num-prompts 256]
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
REPORT_ROWS = {"output_tok_s": r"Output token throughput \(tok/s\):\s+([\d.]+)",
               "mean_ttft_ms": r"Mean TTFT \(ms\):\s+([\d.]+)", "median_ttft_ms": r"Median TTFT \(ms\):\s+([\d.]+)",
               "p99_ttft_ms": r"P99 TTFT \(ms\):\s+([\d.]+)", "duration_s": r"Benchmark duration \(s\):\s+([\d.]+)"}


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_pids(log: str, main_pid: int) -> tuple[list[int], int | None, int]:
    """(API process pids, supervisor pid or None, engine pid) from the start-up log."""
    engine = int(re.search(r"Engine: in process (\d+)", log).group(1))
    pool = re.search(r"API server processes \(pids ([\d, ]+)\)", log)
    if pool is None:
        return [main_pid], None, engine
    return [int(p) for p in pool.group(1).split(", ")], main_pid, engine


def run(model: str, count: int, num_prompts: int, work: Path) -> dict:
    port = free_port()
    log_path = work / f"server{count}.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [PY, "-m", "tengyun.entrypoints.cli.main", "serve", model, "--host", "127.0.0.1", "--port", str(port),
             "--served-model-name", "bench", "--kv-cache-memory", "2GiB", "--dtype", "bfloat16",
             "--max-num-seqs", str(num_prompts), "--disable-uvicorn-access-log", "--api-server-count", str(count)],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None and time.monotonic() < deadline, log_path.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        api, supervisor, engine = server_pids(log_path.read_text(), server.pid)
        watched = {"api": api, "supervisor": [supervisor] if supervisor else [], "engine": [engine]}
        before = {name: [cpu_seconds(p) for p in pids] for name, pids in watched.items()}
        report = subprocess.run(
            [PY, "-m", "tengyun.entrypoints.cli.main", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
             "--model", model, "--served-model-name", "bench", "--dataset", "random", "--input-len", "128",
             "--output-len", "128", "--num-prompts", str(num_prompts), "--ignore-eos", "--disable-tqdm"],
            capture_output=True, text=True, cwd=ROOT, check=True).stdout
        after = {name: [cpu_seconds(p) for p in pids] for name, pids in watched.items()}
        row = {key: float(re.search(pattern, report).group(1)) for key, pattern in REPORT_ROWS.items()}
        row["api_cpu_s"] = [round(a - b, 1) for a, b in zip(after["api"], before["api"])]
        row["supervisor_cpu_s"] = sum(after["supervisor"]) - sum(before["supervisor"])
        row["engine_cpu_s"] = after["engine"][0] - before["engine"][0]
        return row
    finally:
        server.send_signal(2)
        server.wait(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--num-prompts", type=int, default=256)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tengyun.models.model_source import resolve_model

    model = str(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", "auto").folder)
    with tempfile.TemporaryDirectory() as work:
        rows = {count: run(model, count, args.num_prompts, Path(work)) for count in args.counts}
    print(f"{args.num_prompts} streams x 128 in / 128 out, all at once; OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print("| --api-server-count | output tok/s | TTFT mean / median / p99 (ms) | duration (s) "
          "| API processes CPU s (each) | supervisor CPU s | engine CPU s |")
    print("|---|---|---|---|---|---|---|")
    for count, r in rows.items():
        api = f"{sum(r['api_cpu_s']):.1f} ({' + '.join(f'{c:.1f}' for c in r['api_cpu_s'])})"
        print(f"| {count} | {r['output_tok_s']:.1f} | {r['mean_ttft_ms']:.0f} / {r['median_ttft_ms']:.0f} / "
              f"{r['p99_ttft_ms']:.0f} | {r['duration_s']:.1f} | {api} | {r['supervisor_cpu_s']:.1f} "
              f"| {r['engine_cpu_s']:.1f} |")


if __name__ == "__main__":
    main()
