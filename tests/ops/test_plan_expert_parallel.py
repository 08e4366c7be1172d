"""`tengyun plan --enable-expert-parallel`: the MoE experts per card are whole experts (num_experts / tp)
instead of a slice of every expert, the weights per card the same; an expert count the ranks cannot
share whole exits 2 naming both sizes, as `tengyun serve` does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).parents[1] / "fixtures" / "ops"


def _plan(folder, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "plan", str(folder),
                           "--max-model-len", "32768", *args], capture_output=True, text=True, timeout=120)


def test_qwen3_5_397b_tp8_experts_per_card_whole_or_sliced():
    sliced = _plan(FIXTURES / "qwen3_5_397b_a17b", "-tp", "8", "-pp", "4")
    whole = _plan(FIXTURES / "qwen3_5_397b_a17b", "-tp", "8", "-pp", "4", "--enable-expert-parallel")
    assert ("MoE experts per card: all 512 experts, each a 1024 / 8 = 128-row slice (tensor parallel; "
            "--enable-expert-parallel: whole experts) x 3 x 4096 = 805,306,368 params per MoE layer") in sliced.stdout
    assert ("MoE experts per card: 512 experts / 8 EP ranks (--enable-expert-parallel) = 64 whole experts "
            "x 3 x 4096 x 1024 = 805,306,368 params per MoE layer") in whole.stdout
    weights = [line for line in sliced.stdout.splitlines() if line.startswith("Weights per card")]
    assert weights and weights[0] in whole.stdout  # the same bytes either way
    as_json = json.loads(_plan(FIXTURES / "qwen3_5_397b_a17b", "-tp", "8", "--enable-expert-parallel",
                               "--json").stdout)
    assert as_json["expert_parallel"] is True and as_json["experts"].startswith("512 experts / 8 EP ranks")


def test_an_expert_count_the_ranks_cannot_share_whole_exits_2(tmp_path):
    config = json.loads((FIXTURES / "qwen3_5_397b_a17b" / "config.json").read_text())
    config.get("text_config", config)["num_experts"] = 6
    (tmp_path / "config.json").write_text(json.dumps(config))
    run = _plan(tmp_path, "-tp", "4", "--enable-expert-parallel")
    assert run.returncode == 2
    assert ("--enable-expert-parallel divides the 6 experts of each MoE layer whole among the 4 expert-parallel "
            "ranks (--tensor-parallel-size 4), but 4 does not divide 6") in run.stderr
    assert _plan(tmp_path, "-tp", "4").returncode == 0  # slices of every expert: any count
