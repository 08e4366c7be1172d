"""How often a server's start-up thread check moves it to fewer OpenMP threads.

    python benchmarks/startup_threads.py MODEL_FOLDER [--starts 5] [--repo DIR ...]

Starts `python -m tengyun.entrypoints.openai.api_server MODEL_FOLDER` (the server tests' flags:
--kv-cache-memory 64MiB --max-model-len 256) from each --repo checkout in turn (blocks of
--starts, alternating, two rounds), polls /health every 50 ms until 200, stops it, and counts the
starts whose log has "OpenMP threads 2 -> 1 ... a start-up check". Prints one line per checkout.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MOVED = "a start-up check"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_once(repo: Path, model: str, log: Path) -> bool:
    """One start of the server in ``repo`` -> whether its start-up check moved to fewer threads."""
    port = _free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(repo / ".venv/bin/python"), "-m", "tengyun.entrypoints.openai.api_server", model,
                                 "--host", "127.0.0.1", "--port", str(port), "--kv-cache-memory", "64MiB",
                                 "--max-model-len", "256", "--disable-uvicorn-access-log"],
                                cwd=repo, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
            else:
                sys.exit(f"the server in {repo} did not turn /health 200:\n{log.read_text(errors='replace')}")
        finally:
            proc.terminate()
            proc.wait()
    return any("OpenMP threads" in line and MOVED in line for line in log.read_text(errors="replace").splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--starts", type=int, default=5, help="starts per block")
    parser.add_argument("--repo", action="append", type=Path, help="checkouts to compare (default: this one)")
    args = parser.parse_args()
    repos = args.repo or [Path(__file__).resolve().parent.parent]
    moved = {repo: 0 for repo in repos}
    log = Path(tempfile.mkdtemp()) / "server.log"
    for _ in range(2):
        for repo in repos:
            moved[repo] += sum(start_once(repo, args.model, log) for _ in range(args.starts))
    for repo in repos:
        print(f"{repo}: moved to fewer threads in {moved[repo]} of {2 * args.starts} starts")


if __name__ == "__main__":
    main()
