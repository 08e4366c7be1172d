"""The real server as a subprocess on a free loopback port, over a tiny random Llama.

Test modules import the fixtures: `from remote_server import server_model, start_server`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

MAX_MODEL_LEN = 2048  # long enough that a 1,000-token request is surely still running when poked
API_KEY = "sk-tengyun-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`python -m tengyun.entrypoints.openai.api_server MODEL --port P ...`, output in a log file."""

    def __init__(self, model: Path, args: list[str], log_path: Path, python_code: str | None = None,
                 env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = [str(model), "--host", "127.0.0.1", "--port", str(self.port), "--kv-cache-memory", "64MiB",
                "--max-model-len", str(MAX_MODEL_LEN), "--disable-uvicorn-access-log", *args]
        # python_code: a script that patches something, then runs the server's main(sys.argv[1:]).
        cmd = [sys.executable, "-c", python_code, *argv] if python_code else \
            [sys.executable, "-m", "tengyun.entrypoints.openai.api_server", *argv]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 240.0) -> "RemoteServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} before /health turned 200:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        pytest.fail(f"/health did not turn 200 within {timeout} s:\n{self.log()}")

    def wait_exit(self, timeout: float = 120.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"server still running {timeout} s later:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


_models: dict[Path, Path] = {}  # tokenizer dir -> checkpoint, shared by the modules that import this


def running_server(model, args: list[str], log_path: Path, env: dict[str, str] | None = None):
    """A module fixture's body: ``yield from running_server(...)`` serves until the module ends."""
    remote = RemoteServer(model, args, log_path, env=env)
    try:
        yield remote.wait_ready()
    finally:
        remote.stop()


@pytest.fixture(scope="session")
def server_model(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    from conftest import make_tiny_checkpoint  # tests/conftest.py

    if tiny_tokenizer_dir not in _models:
        _models[tiny_tokenizer_dir] = make_tiny_checkpoint(
            tmp_path_factory.mktemp("server_llama"), tiny_tokenizer_dir, "llama",
            max_position_embeddings=MAX_MODEL_LEN)
    return _models[tiny_tokenizer_dir]


@pytest.fixture
def start_server(server_model, tmp_path):
    """start_server(*flags, python_code=None) -> RemoteServer, not yet waited for; stopped at teardown."""
    servers: list[RemoteServer] = []

    def start(*args: str, python_code: str | None = None, env: dict[str, str] | None = None) -> RemoteServer:
        server = RemoteServer(server_model, list(args), tmp_path / f"server{len(servers)}.log", python_code, env)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
