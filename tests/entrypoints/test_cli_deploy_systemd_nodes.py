"""`tengyun deploy systemd --nnodes N --node-rank R`: one command writes every node's unit; nodes
1..N-1 run --headless under `tengyun supervise`, which watches that node's own /health; flags
that contradict the serve flags are refused (exit 2)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tengyun.entrypoints.cli.main import main

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
SERVE = ("--", "serve", "/models/m", "-tp", "2", "--master-addr", "10.0.0.1", "--master-port", "29500",
         "--port", "8000")


def deploy(capsys, *flags: str, serve: tuple[str, ...] = SERVE) -> tuple[int, str, str]:
    code = main(["deploy", "systemd", "--no-capture-env", "--supervise", *flags, *serve])
    out, err = capsys.readouterr()
    return code, out, err


def exec_start(unit: str) -> list[str]:
    return next(line for line in unit.splitlines() if line.startswith("ExecStart=")).split()[1:]


@pytest.mark.parametrize("rank, headless", [(0, False), (1, True), (3, True)])
def test_each_node_gets_its_rank_and_only_nodes_past_0_run_headless(capsys, rank, headless):
    code, unit, _ = deploy(capsys, "--nnodes", "4", "--node-rank", str(rank))
    assert code == 0
    argv = exec_start(unit)
    assert argv[:3] == ["supervise", "--", "serve"]
    assert argv[-5:-1] == ["--nnodes", "4", "--node-rank", str(rank)] if headless else \
        argv[-4:] == ["--nnodes", "4", "--node-rank", str(rank)]
    assert ("--headless" in argv) is headless and argv.count("--headless") <= 1
    assert f"Description=Tengyun LLM server node {rank} of 4: " in unit


def test_a_headless_flag_already_in_the_serve_flags_is_kept_once(capsys):
    code, unit, _ = deploy(capsys, "--nnodes", "2", "--node-rank", "1", serve=(*SERVE, "--headless", "--nnodes=2"))
    assert code == 0
    argv = exec_start(unit)
    assert argv.count("--headless") == 1 and argv.count("--nnodes") == 1 and "--nnodes=2" not in argv


@pytest.mark.parametrize("flags, serve_extra, message", [
    (("--nnodes", "2"), (), "give both"),
    (("--nnodes", "2", "--node-rank", "2"), (), "0 <= --node-rank < --nnodes"),
    (("--nnodes", "2", "--node-rank", "1"), ("--nnodes", "4"), "--nnodes 2 of `deploy systemd` differs"),
    (("--nnodes", "2", "--node-rank", "0"), ("--headless",), "--node-rank 0 runs the engine: drop --headless"),
])
def test_contradicting_node_flags_exit_2_naming_them(capsys, flags, serve_extra, message):
    code, out, err = deploy(capsys, *flags, serve=(*SERVE, *serve_extra))
    assert code == 2 and out == ""
    assert message in err


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed")
def test_a_headless_node_unit_passes_systemd_analyze_verify(capsys, tmp_path):
    code, unit, _ = deploy(capsys, "--nnodes", "2", "--node-rank", "1")
    assert code == 0
    path = tmp_path / "tengyun-node1.service"
    path.write_text(unit)
    run = subprocess.run([SYSTEMD_ANALYZE, "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stderr == "", run.stderr  # warnings (bad quoting, unknown keys) go to stderr
