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


DP_SERVE = ("--", "serve", "/models/m", "-dp", "4", "-dpa", "10.0.0.1", "-dpp", "13345", "--port", "8000")


@pytest.mark.parametrize("rank, node_flags", [
    (0, ["--data-parallel-size-local", "2"]),
    (1, ["--data-parallel-size-local", "2", "--headless", "--data-parallel-start-rank", "2"]),
])
def test_data_parallel_nodes_run_their_own_replicas_and_nodes_past_0_run_them_headless(capsys, rank, node_flags):
    code, unit, _ = deploy(capsys, "--nnodes", "2", "--node-rank", str(rank), serve=(*DP_SERVE, "-dpl", "2"))
    assert code == 0
    assert exec_start(unit) == ["supervise", "--", "serve", *DP_SERVE[2:], *node_flags]  # no --nnodes: whole replicas
    assert f"Description=Tengyun LLM server node {rank} of 2: " in unit


def test_a_data_parallel_node_is_given_its_share_of_replicas_when_the_serve_flags_do_not_say(capsys):
    code, unit, _ = deploy(capsys, "--nnodes", "4", "--node-rank", "3", serve=(*DP_SERVE, "--headless", "-dpr", "3"))
    assert code == 0
    assert exec_start(unit)[-5:] == ["--data-parallel-size-local", "1", "--headless", "--data-parallel-start-rank", "3"]
    assert exec_start(unit).count("--headless") == 1 and "-dpr" not in exec_start(unit)


@pytest.mark.parametrize("flags, serve, message", [
    (("--nnodes", "3", "--node-rank", "1"), DP_SERVE,
     "--nnodes 3 x 4 / 3 replicas per node != --data-parallel-size 4"),
    (("--nnodes", "2", "--node-rank", "1"), (*DP_SERVE, "-dpl", "1"),
     "--nnodes 2 x --data-parallel-size-local 1 replicas per node != --data-parallel-size 4"),
    (("--nnodes", "2", "--node-rank", "1"), (*DP_SERVE, "-dpr", "3"),
     "--data-parallel-start-rank 3 in the serve flags differs from node 1's first replica 2"),
    (("--nnodes", "2", "--node-rank", "1"), ("--", "serve", "/models/m", "-dp", "2"),
     "--data-parallel-size 2 over --nnodes 2 needs --data-parallel-address"),
])
def test_data_parallel_node_flags_that_contradict_exit_2_naming_them(capsys, flags, serve, message):
    code, out, err = deploy(capsys, *flags, serve=serve)
    assert code == 2 and out == ""
    assert message in err
