"""A server's start: seconds until /health turns 200, and how often its start-up thread check
moves it to fewer OpenMP threads.

    python benchmarks/server_startup.py MODEL_FOLDER [--starts 5] [--repo DIR ...] [-- SERVE_ARGS]

Starts `python -m tengyun.entrypoints.openai.api_server MODEL_FOLDER` with the server tests'
flags (--kv-cache-memory 64MiB --max-model-len 256), or with SERVE_ARGS after `--` instead (the
serve sweep's: `--dtype bfloat16 --kv-cache-memory 1GiB --max-model-len 2048`), from each --repo
checkout in turn (blocks of --starts, alternating, two rounds), polls /health every 50 ms until
200, stops it. Prints one line per checkout: the seconds from Popen to /health 200 (median, min,
max), the server's own "Ready in" figure (from its engine's load to ready: median, min, max),
the seconds from the engine's last start-up line ("Memory on rank 0") to "Ready in" (the API
process's tokenizer and the warm-up request), and the starts whose log has
"OpenMP threads 2 -> 1 ... a start-up check".
"""

from __future__ import annotations

import argparse
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

MOVED = "a start-up check"
READY = re.compile(r"Ready in ([0-9.]+) s")
STAMP = r"(\d\d:\d\d:\d\d,\d\d\d) "  # the time in a log line of ours (INFO 2026-12-07 10:09:26,059 ...)
ENGINE_READY = re.compile(STAMP + r"tengyun\.worker\.worker: Memory on rank 0")  # the engine's last line
SERVER_READY = re.compile(STAMP + r"tengyun\.server: Ready in")


@dataclass
class Start:
    seconds: float  # Popen to /health 200, as the client saw it
    ready_in: float  # the server's "Ready in" line
    moved: bool  # its start-up check moved to fewer threads
    after_engine: float  # from the engine's last start-up line to the server's "Ready in": tokenizer, warm-up


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TEST_FLAGS = ["--kv-cache-memory", "64MiB", "--max-model-len", "256"]


def start_once(repo: Path, model: str, log: Path, serve_args: list[str]) -> Start:
    """One start of the server in ``repo``, stopped once /health is 200."""
    port = _free_port()
    with open(log, "wb") as out:
        began = time.monotonic()
        proc = subprocess.Popen([str(repo / ".venv/bin/python"), "-m", "tengyun.entrypoints.openai.api_server", model,
                                 "--host", "127.0.0.1", "--port", str(port), *serve_args,
                                 "--disable-uvicorn-access-log"],
                                cwd=repo, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = began + 120
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
            else:
                sys.exit(f"the server in {repo} did not turn /health 200:\n{log.read_text(errors='replace')}")
            seconds = time.monotonic() - began
        finally:
            proc.terminate()
            proc.wait()
    text = log.read_text(errors="replace")
    moved = any("OpenMP threads" in line and MOVED in line for line in text.splitlines())
    return Start(seconds, float(READY.search(text).group(1)), moved,
                 _seconds(SERVER_READY.search(text).group(1)) - _seconds(ENGINE_READY.search(text).group(1)))


def _seconds(stamp: str) -> float:
    hours, minutes, seconds = stamp.replace(",", ".").split(":")
    return 3600 * int(hours) + 60 * int(minutes) + float(seconds)


def summary(repo: Path, starts: list[Start]) -> str:
    seconds = [s.seconds for s in starts]
    ready_in = [s.ready_in for s in starts]
    return (f"{repo}: /health 200 after {statistics.median(seconds):.2f} s median ({min(seconds):.2f}-"
            f"{max(seconds):.2f}) over {len(starts)} starts; 'Ready in' {statistics.median(ready_in):.1f} s "
            f"median ({min(ready_in):.1f}-{max(ready_in):.1f}); engine ready to server ready "
            f"{statistics.median(s.after_engine for s in starts):.2f} s median "
            f"({min(s.after_engine for s in starts):.2f}-{max(s.after_engine for s in starts):.2f}); "
            f"moved to fewer threads in {sum(s.moved for s in starts)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--starts", type=int, default=5, help="starts per block")
    parser.add_argument("--repo", action="append", type=Path, help="checkouts to compare (default: this one)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)  # after it: the server's flags
    args = parser.parse_args(argv[:split])
    serve_args = argv[split + 1:] or TEST_FLAGS
    repos = args.repo or [Path(__file__).resolve().parent.parent]
    starts: dict[Path, list[Start]] = {repo: [] for repo in repos}
    log = Path(tempfile.mkdtemp()) / "server.log"
    for _ in range(2):
        for repo in repos:
            starts[repo] += [start_once(repo, args.model, log, serve_args) for _ in range(args.starts)]
    for repo in repos:
        print(summary(repo, starts[repo]))


if __name__ == "__main__":
    main()
