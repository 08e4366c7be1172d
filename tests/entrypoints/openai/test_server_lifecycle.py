"""Readiness and shutdown: /health before warm-up, SIGTERM drains in-flight requests and exits
0, a dead engine loop (or a killed engine process) gives 503 and exit 1, a start-up failure
exits 2 naming the flag."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from remote_server import server_model, start_server  # noqa: F401 (fixtures)

PROMPT = "The quick brown fox"


def assert_error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    for word in words:
        assert word in error["message"]


def wait_for_health(url: str, status: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/health", timeout=30).status_code != status:
        assert time.monotonic() < deadline, f"/health never returned {status}"
        time.sleep(0.05)


def test_sigterm_finishes_the_in_flight_request_refuses_new_ones_and_exits_zero(start_server):  # noqa: F811
    server = start_server("--shutdown-timeout", "600").wait_ready()
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
        events = (line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))
        first = next(events)
        server.proc.send_signal(signal.SIGTERM)
        wait_for_health(server.url, 503)
        assert_error(httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=30), 503,
                     "shutting down")
        rest = list(events)
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(e) for e in [first] + rest[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] \
        == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 200
    assert server.wait_exit() == 0, server.log()
    assert "finishing 1 in-flight request(s)" in server.log()  # it was mid-flight when the signal came


DIE_WHEN_FILE_EXISTS = """
import os, sys
from tengyun.engine.llm_engine import LLMEngine

real_step = LLMEngine.step_with_progress  # what the server's engine loop calls each step

def step(self):
    if os.path.exists(os.environ["DIE_FILE"]):
        raise RuntimeError("injected device failure")
    return real_step(self)

LLMEngine.step_with_progress = step
from tengyun.entrypoints.openai.api_server import main
sys.exit(main(sys.argv[1:]))
"""


def test_dead_engine_loop_fails_the_request_and_exits_nonzero(start_server, tmp_path):  # noqa: F811
    die_file = tmp_path / "die"
    server = start_server(python_code=DIE_WHEN_FILE_EXISTS, env={"DIE_FILE": str(die_file)}).wait_ready()
    die_file.touch()
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5}, timeout=120)
    assert_error(r, 503, "injected device failure")
    assert server.wait_exit() == 1
    assert "The engine loop died: RuntimeError: injected device failure" in server.log()


LOAD_WHEN_FILE_EXISTS = """
import os, sys, time
from tengyun.engine import engine_process

real_build = engine_process._build_llm_engine  # what the forked engine process runs first

def build(config):
    while not os.path.exists(os.environ["LOAD_FILE"]):
        time.sleep(0.05)
    return real_build(config)

engine_process._build_llm_engine = build
from tengyun.entrypoints.openai.api_server import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_api_process_imports_its_tokenizer_library_while_the_engine_loads(start_server, tmp_path):  # noqa: F811
    load_file = tmp_path / "load"
    server = start_server(python_code=LOAD_WHEN_FILE_EXISTS, env={"LOAD_FILE": str(load_file)})
    maps = Path(f"/proc/{server.proc.pid}/maps")
    deadline = time.monotonic() + 60
    while "tokenizers.abi3" not in maps.read_text() and time.monotonic() < deadline:  # its Rust library
        time.sleep(0.1)
    assert "tokenizers.abi3" in maps.read_text()  # while the engine process has not begun to load
    assert _health(server, deadline) == 503
    load_file.touch()
    server.wait_ready()


def _health(server, deadline: float) -> int:
    """/health's status once the port answers."""
    while True:
        try:
            return httpx.get(server.url + "/health", timeout=30).status_code
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_the_http_side_is_imported_after_the_engine_process_is_forked():
    """api_server forks the engine, then imports http_server: FastAPI and uvicorn's ~0.45 s of
    imports overlap the engine's load instead of delaying its start."""
    script = ("import sys, tengyun.entrypoints.openai.api_server\n"
              "print([m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_engine_runs_in_its_own_process_which_dying_gives_503_and_exit_1(start_server):  # noqa: F811
    server = start_server().wait_ready()
    pid = int(re.search(r"Engine: in process (\d+)", server.log()).group(1))
    with open(f"/proc/{pid}/stat") as stat:
        assert int(stat.read().rsplit(")", 1)[1].split()[1]) == server.proc.pid  # its parent: the server
    assert httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3},
                      timeout=120).status_code == 200
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert re.search(r"^tengyun_engine_process_resident_memory_bytes \d", metrics, re.M)
    assert re.search(r"^process_resident_memory_bytes \d", metrics, re.M)  # the server process's own
    # A request in flight when the engine dies gets the 503 (one sent after it could find the server
    # already gone: it exits 1 as soon as it sees the death, which raced a request sent then).
    replies = []
    sender = threading.Thread(target=lambda: replies.append(httpx.post(
        server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}, timeout=120)))
    sender.start()
    deadline = time.monotonic() + 60
    while not re.search(r"^tengyun:num_requests_running\S* 1", httpx.get(server.url + "/metrics", timeout=30).text,
                        re.M):
        assert time.monotonic() < deadline and sender.is_alive(), "the request never ran"
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)  # as the kernel's OOM killer would
    sender.join(timeout=120)
    assert_error(replies[0], 503, "The engine process exited unexpectedly (killed by SIGKILL")
    assert server.wait_exit() == 1


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return "libtorch" in maps.read()


def test_the_api_process_of_a_cpu_server_never_loads_torch(start_server):  # noqa: F811
    """Platform selection reads torch's CUDA build from torch/version.py (platforms/cuda/platform.py), so
    the API process forks its engine without importing torch (~200 MiB of RSS): only the engine
    process maps libtorch, also after requests are served."""
    server = start_server().wait_ready()
    engine = int(re.search(r"Engine: in process (\d+)", server.log()).group(1))
    for stream in (False, True):
        assert httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": stream},
                          timeout=120).status_code == 200
    assert _maps_torch(engine) and not _maps_torch(server.proc.pid)


def test_the_api_process_parses_http_with_httptools_and_says_so(start_server):  # noqa: F811
    """uvicorn serves with httptools' C parser (a dependency), not pure-Python h11: the API process
    maps the parser's extension, streams a completion through it, and its log names the protocol."""
    server = start_server().wait_ready()
    body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and len(events) == 9 and events[-1] == "data: [DONE]"
    with open(f"/proc/{server.proc.pid}/maps") as maps:
        assert "httptools/parser" in maps.read()
    assert "HTTP/1.1: uvicorn's HttpToolsProtocol" in server.log()


def test_serving_with_h11_warns_naming_the_package(caplog):
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from tengyun.entrypoints.openai.draining_server import log_http_parser

    with caplog.at_level("INFO", logger="tengyun.server"):
        log_http_parser(H11Protocol)
    assert caplog.records[-1].levelname == "WARNING" and "pip install httptools" in caplog.text


def test_start_up_failure_exits_2_naming_the_flag(start_server):  # noqa: F811
    server = start_server("--kv-cache-memory", "16KiB")
    assert server.wait_exit() == 2
    assert "--kv-cache-memory" in server.log() and "Traceback" not in server.log()


def test_health_is_503_until_warm_and_after_the_engine_dies(server_model):  # noqa: F811
    from tengyun.config import EngineConfig
    from tengyun.entrypoints.openai.http_server import build_host
    from tengyun.entrypoints.openai.routes import build_app
    from tengyun.entrypoints.openai.server_config import ServerConfig

    config = EngineConfig(model=str(server_model), kv_cache_memory="8MiB", max_model_len=256).finalize()
    state = build_host(config, ServerConfig(disable_log_stats=True, device_metrics_interval=0))
    app = build_app(state)
    body = {"prompt": PROMPT, "max_tokens": 3}

    def boom():
        raise RuntimeError("injected device failure")

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tengyun") as http:
            assert_error(await http.get("/health"), 503, "starting")
            assert_error(await http.post("/v1/completions", json=body), 503, "starting")
            await state.start_engine()
            try:
                assert state.lifecycle.ready and (await http.get("/health")).status_code == 200
                assert (await http.post("/v1/completions", json=body)).status_code == 200
                assert state.lifecycle.exit_code() is None
                state.engine.engine.step_with_progress = boom
                assert_error(await http.post("/v1/completions", json=body), 503, "injected device failure")
                assert_error(await http.get("/health"), 503, "injected device failure")
                assert state.lifecycle.exit_code() == 1
            finally:
                state.engine.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize("value, expected", [('["http://a", "http://b"]', ["http://a", "http://b"]),
                                             ("http://a, http://b", ["http://a", "http://b"]), ("*", ["*"])])
def test_list_flags_take_json_or_commas(value, expected):
    from tengyun.entrypoints.openai.server_config import list_arg

    assert list_arg(value) == expected


def test_tengyun_serve_takes_engine_and_server_flags(capsys):
    from tengyun.entrypoints.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    usage = capsys.readouterr().out
    for flag in ("--max-model-len", "--enable-prefix-caching", "--kv-cache-dtype", "--api-key", "--port",
                 "--allowed-origins", "--disable-log-stats", "--shutdown-timeout", "--served-model-name"):
        assert flag in usage
