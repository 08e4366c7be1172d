"""`python -m tengyun.entrypoints.cli.main ARGS` (serve, supervise, launch) in the background for
the production tests: the `tengyun` fixture starts them and stops them at teardown.

Test modules import it: `from cli_process import tengyun, wait_health`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

# One OpenMP thread per server (several run at once); no API key leaks in from the caller's shell.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TENGYUN_API_KEY": "", "VLLM_API_KEY": ""}


class Tengyun:
    """`python -m tengyun.entrypoints.cli.main ARGS` in the background, output in a log file."""

    def __init__(self, args: list[str], log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "tengyun.entrypoints.cli.main", *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=ENV)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, pattern: str, count: int = 1, timeout: float = 240.0) -> list[re.Match]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = list(re.finditer(pattern, self.log()))
            if len(found) >= count:
                return found
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}:\n{self.log()}"
            time.sleep(0.1)
        pytest.fail(f"{pattern!r} x{count} not logged within {timeout} s:\n{self.log()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def tengyun(tmp_path):
    started: list[Tengyun] = []

    def start(*args: str) -> Tengyun:
        t = Tengyun(list(args), tmp_path / f"tengyun{len(started)}.log")
        started.append(t)
        return t

    yield start
    for t in started:
        t.stop()


def wait_health(url: str, timeout: float = 240.0, poll: float = 0.05, log=None) -> None:
    """Until url/health answers 200; on timeout the failure shows log() (the server's output)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(poll)
    pytest.fail(f"{url}/health did not turn 200 within {timeout} s" + (f":\n{log()}" if log else ""))
