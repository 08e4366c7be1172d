"""tcmalloc under `tengyun serve` on CPU (platforms/cpu/runtime/tcmalloc_preload.py): when the server re-executes
itself with tcmalloc preloaded, and a real server that did (same pid, tcmalloc in its memory map
and its engine process's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tengyun.platforms.cpu.runtime import tcmalloc_preload as ap

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints" / "openai"))
from remote_server import RemoteServer, server_model  # noqa: E402, F401 (fixture)

LIB = "libtcmalloc_minimal.so.4"


def plan(args=(), env=None, found=LIB, accelerators=False):
    return ap.preload_env(list(args), env or {}, find=lambda: found, accelerators=lambda: accelerators)


def test_cpu_server_preloads_tcmalloc_first_and_keeps_the_users_preloads():
    env = plan(env={"LD_PRELOAD": "/opt/libfoo.so", "HOME": "/root"})
    assert env["LD_PRELOAD"] == f"{LIB}:/opt/libfoo.so"
    assert env[ap.PRELOADED_ENV] == LIB and env["HOME"] == "/root"
    assert plan()["LD_PRELOAD"] == LIB


@pytest.mark.parametrize("args, env, accelerators", [
    ((), {ap.CHOICE_ENV: "system"}, False),  # the user said no
    ((), {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, False),  # their own allocator
    ((), {"LD_PRELOAD": "libtcmalloc.so.4"}, False),
    ((), {ap.PRELOADED_ENV: LIB}, False),  # already re-executed: never twice
    (("--device", "cuda"), {}, False),
    (("--device=npu",), {}, False),
    ((), {}, True),  # --device auto on a machine with /dev/nvidia0 or /dev/davinci0
])
def test_left_as_it_is(args, env, accelerators):
    assert plan(args, env, accelerators=accelerators) is None


def test_device_cpu_preloads_even_beside_an_accelerator():
    assert plan(["model", "--device", "cpu"], accelerators=True)["LD_PRELOAD"] == LIB


def test_missing_tcmalloc_runs_on_glibc_unless_required():
    assert plan(found=None) is None
    with pytest.raises(ValueError, match=r"TENGYUN_CPU_ALLOCATOR=tcmalloc .*apt install libtcmalloc-minimal4"):
        plan(env={ap.CHOICE_ENV: "tcmalloc"}, found=None)


def test_unknown_choice_names_the_variable_and_choices():
    with pytest.raises(ValueError, match=r"\$TENGYUN_CPU_ALLOCATOR must be one of auto, tcmalloc, system; "
                                         r"got 'jemalloc'"):
        plan(env={ap.CHOICE_ENV: "jemalloc"})


def test_bad_choice_exits_2_before_serving():
    run = subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "serve", "no-such-model"],
                         capture_output=True, text=True, timeout=120, env={"TENGYUN_CPU_ALLOCATOR": "bogus",
                                                                           "PATH": "/usr/bin:/bin"})
    assert run.returncode == 2 and "$TENGYUN_CPU_ALLOCATOR must be one of" in run.stderr


@pytest.mark.parametrize("env, found, line", [
    ({ap.PRELOADED_ENV: LIB}, LIB, f"CPU allocator: tcmalloc ({LIB}, preloaded"),
    ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, None, "CPU allocator: jemalloc (from your LD_PRELOAD)"),
    ({}, None, "CPU allocator: glibc malloc; tcmalloc was not found (on Debian and Ubuntu: apt install"),
    ({}, LIB, f"CPU allocator: glibc malloc; {LIB} is installed but not preloaded (LD_PRELOAD={LIB})"),
])
def test_the_start_up_line_names_the_allocator(monkeypatch, caplog, env, found, line):
    monkeypatch.setattr(ap, "find_tcmalloc", lambda: found)
    for name in ("LD_PRELOAD", ap.PRELOADED_ENV, ap.CHOICE_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level("INFO", logger=ap.__name__):
        ap.log_allocator("cpu")
    assert line in caplog.text


def test_a_failed_re_execution_serves_as_it_is(monkeypatch, caplog):
    def refuse(*args):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(ap, "preload_env", lambda args, env: {**env, ap.PRELOADED_ENV: LIB})
    monkeypatch.setattr(ap.os, "execve", refuse)
    with caplog.at_level("WARNING", logger=ap.__name__):
        ap.reexec_under_tcmalloc([])  # returns
    assert f"could not re-execute under {LIB}" in caplog.text and "Permission denied" in caplog.text


def _maps_tcmalloc(pid: int) -> bool:
    return "tcmalloc" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(ap.find_tcmalloc() is None, reason="no tcmalloc on this machine (apt install libtcmalloc-minimal4)")
def test_a_real_server_runs_on_tcmalloc_in_the_same_process(server_model, tmp_path):  # noqa: F811
    server = RemoteServer(server_model, [], tmp_path / "server.log", env={"TENGYUN_CPU_ALLOCATOR": "auto"})
    try:
        server.wait_ready()
        assert _maps_tcmalloc(server.proc.pid)  # the pid Popen returned: re-executed in place
        children = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
        assert children and all(_maps_tcmalloc(int(pid)) for pid in children)  # the engine process
        assert "CPU allocator: tcmalloc" in server.log()
    finally:
        server.stop()
    plain = RemoteServer(server_model, [], tmp_path / "plain.log", env={"TENGYUN_CPU_ALLOCATOR": "system"})
    try:
        plain.wait_ready()
        assert not _maps_tcmalloc(plain.proc.pid)
    finally:
        plain.stop()


def _api_server_command(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """`python -m tengyun.entrypoints.openai.api_server ARGS` with PYTHONPROFILEIMPORTTIME: every
    process it runs as (before and after re-executing) writes one stderr line per module imported."""
    clean = {k: v for k, v in os.environ.items() if k not in (ap.PRELOADED_ENV, ap.CHOICE_ENV, "LD_PRELOAD")}
    return subprocess.run([sys.executable, "-m", "tengyun.entrypoints.openai.api_server", *args],
                          env={**clean, "PYTHONPROFILEIMPORTTIME": "1", **env}, capture_output=True, text=True,
                          timeout=120)


def _imports_of(module: str, stderr: str) -> int:
    return sum(line.startswith("import time:") and line.split("|")[-1].strip() == module
               for line in stderr.splitlines())


@pytest.mark.skipif(ap.find_tcmalloc() is None, reason="no tcmalloc on this machine (apt install libtcmalloc-minimal4)")
def test_python_m_api_server_re_executes_before_importing_the_server(tmp_path):
    missing = str(tmp_path / "no-model")  # re-executes, imports the server, then exits 2 naming the folder
    done = _api_server_command([missing], TENGYUN_CPU_ALLOCATOR="auto")
    assert done.returncode == 2 and "no-model" in done.stderr
    assert _imports_of("tengyun.platforms.cpu.runtime.tcmalloc_preload", done.stderr) == 2  # it re-executed
    assert _imports_of("tengyun.entrypoints.openai.cli_args", done.stderr) == 1  # the server's modules once
    plain = _api_server_command([missing], TENGYUN_CPU_ALLOCATOR="system")
    assert _imports_of("tengyun.platforms.cpu.runtime.tcmalloc_preload", plain.stderr) == 1


def test_python_m_api_server_with_a_bad_allocator_choice_exits_2_naming_it(tmp_path):
    done = _api_server_command([str(tmp_path / "no-model")], TENGYUN_CPU_ALLOCATOR="jemalloc")
    assert done.returncode == 2
    assert "error: $TENGYUN_CPU_ALLOCATOR must be one of auto, tcmalloc, system; got 'jemalloc'" in done.stderr
    assert _imports_of("tengyun.entrypoints.openai.cli_args", done.stderr) == 0
