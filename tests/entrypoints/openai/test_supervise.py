"""`tengyun supervise` and `tengyun launch` with real servers on loopback (no nginx needed):
the key given as --api-key never reaches a server's command line, only its environment; a
server that hangs in start-up is restarted after --start-stall-timeout."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from cli_process import tengyun, wait_health  # noqa: F401 (fixture)
from remote_server import MAX_MODEL_LEN, free_port, server_model  # noqa: F401 (fixture)

KEY = "sk-supervised-secret"
SERVE_FLAGS = ["--kv-cache-memory", "64MiB", "--max-model-len", str(MAX_MODEL_LEN), "--disable-uvicorn-access-log",
               "--disable-log-stats"]


def status_with_key(url: str, key: str) -> int:
    return httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code


@pytest.mark.parametrize("serve_args, rest, key", [
    (["M", "--api-key", "K", "--port", "1"], ["M", "--port", "1"], "K"),
    (["M", "--api-key=K"], ["M"], "K"),
    (["M", "--api-key", "A", "--api-key=B"], ["M"], "B"),  # the last one wins, as in argparse
    (["M", "--api-key-file", "/etc/k"], ["M", "--api-key-file", "/etc/k"], None),  # a path is no secret
    (["M", "--chat-template={{x}} --api-key=K"], ["M", "--chat-template={{x}} --api-key=K"], None),  # a value
])
def test_pop_api_key_takes_only_the_key_off_the_serve_flags(serve_args, rest, key):
    from tengyun.entrypoints.cli.supervise import pop_api_key

    assert pop_api_key(serve_args) == (rest, key)


def cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def environ(pid: int) -> bytes:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read()


@pytest.mark.parametrize("command", ["supervise", "launch"])
def test_key_given_as_flag_reaches_the_server_in_its_environment_not_its_command_line(
        command, server_model, tengyun, tmp_path):  # noqa: F811
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = ["serve", str(server_model), *SERVE_FLAGS, "--api-key", KEY]
    if command == "supervise":
        t = tengyun("supervise", "--check-interval", "1", "--", *serve, "--host", "127.0.0.1", "--port", str(port))
        pid_line = r"Started the server: pid (\d+)"
    else:
        t = tengyun("launch", "--instances", "1", "--base-port", str(port), "--no-nginx",
                    "--nginx-dir", str(tmp_path / "nginx"), "--", *serve)
        pid_line = r"Instance 0: pid (\d+)"
    wait_health(url)
    pid = int(t.wait_log(pid_line)[-1].group(1))
    assert KEY.encode() not in cmdline(pid) and b"--api-key" not in cmdline(pid), cmdline(pid)
    assert f"TENGYUN_API_KEY={KEY}".encode() in environ(pid).split(b"\0")  # readable by its owner only
    assert status_with_key(url, KEY) == 200
    assert status_with_key(url, "sk-wrong") == 401
    log = t.log()
    assert f"--api-key is on the command line of `tengyun {command}`" in log
    assert "--api-key puts the key on the command line" not in log  # the server did not get it as a flag
    assert KEY not in log
    assert t.stop() == 0, t.log()


def hanging_model(server_model: Path, folder: Path) -> Path:  # noqa: F811
    """The test model with its weights file replaced by a FIFO nobody writes to: the loader's
    open() blocks forever, as on a hung network mount. The engine process that loads it uses no
    CPU; the server process answers /health 503 and, on SIGTERM, kills it and exits."""
    folder.mkdir()
    for f in server_model.iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    os.mkfifo(folder / "model.safetensors")
    return folder


def test_an_engine_process_blocked_in_its_load_dies_with_a_killed_server(server_model, tengyun, tmp_path):  # noqa: F811
    """The engine process's main thread is stuck in open() (holding the GIL), so it reads no end
    of file and no Python thread can run: the kernel kills it when the server goes
    (PR_SET_PDEATHSIG). It spends no CPU meanwhile (the stall check above relies on that)."""
    model = hanging_model(server_model, tmp_path / "hangs")
    t = tengyun("serve", str(model), *SERVE_FLAGS, "--host", "127.0.0.1", "--port", str(free_port()))
    engine = int(t.wait_log(r"Engine: in process (\d+)")[0].group(1))

    def cpu_ticks() -> int:
        with open(f"/proc/{engine}/stat") as stat:
            return sum(int(v) for v in stat.read().rsplit(")", 1)[1].split()[11:13])

    deadline, last = time.monotonic() + 60, -1
    while cpu_ticks() != last and time.monotonic() < deadline:  # importing torch first, then the blocked open()
        last = cpu_ticks()
        time.sleep(1)
    before = cpu_ticks()
    time.sleep(3)
    assert cpu_ticks() - before <= 1  # clock ticks
    os.kill(t.proc.pid, signal.SIGKILL)
    t.proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{engine}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{engine}") or open(f"/proc/{engine}/stat").read().split(")")[1].split()[0] == "Z"


def test_start_up_that_hangs_is_restarted_after_the_stall_timeout_not_the_start_timeout(
        server_model, tengyun, tmp_path):  # noqa: F811
    model = hanging_model(server_model, tmp_path / "hangs")
    t = tengyun("supervise", "--check-interval", "0.5", "--start-timeout", "600", "--start-stall-timeout", "4", "--",
                "serve", str(model), *SERVE_FLAGS, "--host", "127.0.0.1", "--port", str(free_port()))
    first = int(t.wait_log(r"Started the server: pid (\d+)")[0].group(1))
    started = time.monotonic()
    t.wait_log(r"Restart 1 \(start_stall\): start-up stalled: not ready, and \d+\.\d\d s of CPU in the last \d+ s "
               r"\(under 1% of a core\) > --start-stall-timeout 4 s", timeout=120)
    assert time.monotonic() - started < 120  # not the 600 s --start-timeout
    assert re.search(rf"Stopping pid {first} gracefully \(SIGTERM; in-flight requests finish within 0 s, "
                     r"SIGKILL 15 s later\)", t.log())  # never ready: nothing to drain
    t.wait_log(rf"pid {first} exited with code 0", timeout=60)  # SIGTERM: nothing to drain, no SIGKILL needed
    first_engine = int(re.search(r"Engine: in process (\d+)", t.log()).group(1))
    second = int(t.wait_log(r"Started the server: pid (\d+)", 2)[1].group(1))
    assert second != first and not os.path.exists(f"/proc/{first}") and not os.path.exists(f"/proc/{first_engine}")
