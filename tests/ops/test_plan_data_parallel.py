"""`tengyun plan` with --data-parallel-size: attention and every other non-expert weight repeated
per replica, expert-parallel experts divided among all dp x tp ranks, figures by hand for
Qwen3.5-397B-A17B; the 32-card cluster as TP 8 x PP 4 and as DP 4 x TP 8 with EP 32 side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tengyun.config import EngineConfig
from tengyun.model_spec import as_spec
from tengyun.ops.plan import report_lines
from tengyun.sizing.plan import make_plan
from tengyun.sizing.resolve import resolve_sizing

CONFIG = Path(__file__).parents[1] / "fixtures" / "ops" / "qwen3_5_397b_a17b" / "config.json"
H, INTER, EXPERTS, LAYERS = 4096, 1024, 512, 60  # hidden, moe_intermediate, routed experts, decoder layers


def _plan(**flags):
    cfg = json.loads(CONFIG.read_text())
    return make_plan(cfg, resolve_sizing(EngineConfig(max_model_len=32768, **flags), as_spec(cfg), "npu"))


def test_dp4_tp8_ep32_holds_16_whole_experts_and_a_replica_of_everything_else_per_card():
    dp_ep = _plan(data_parallel_size=4, tensor_parallel_size=8, enable_expert_parallel=True)
    tp8 = _plan(tensor_parallel_size=8)  # the same replica without DP: experts sliced over TP 8
    [card], [tp8_card] = dp_ep.stages, tp8.stages
    # per MoE layer: 512 / 32 = 16 whole experts (gate, up, down) + router 512 x 4096 + the shared
    # expert (intermediate 512 in this config) sliced over TP 8 + its 1 x 4096 gate
    shared = as_spec(json.loads(CONFIG.read_text())).moe.shared_intermediate_size
    per_layer = 16 * 3 * H * INTER + EXPERTS * H + 3 * H * shared // 8 + H
    assert card.params.mlp == LAYERS * per_layer
    assert tp8_card.params.mlp - card.params.mlp == LAYERS * (EXPERTS * 3 * H * INTER // 8 - 16 * 3 * H * INTER)
    for part in ("embedding", "attention", "linear_attention", "norms", "lm_head"):  # replicated per replica
        assert getattr(card.params, part) == getattr(tp8_card.params, part), part
    assert card.kv_bytes_per_token == tp8_card.kv_bytes_per_token  # each replica its own KV cache
    report = "\n".join(report_lines(dp_ep, None))
    assert "Plan: DP 4 x TP 8 x PP 1 (EP 32) = 32 card(s)" in report
    assert "512 experts / 32 EP ranks (DP 4 x TP 8, --enable-expert-parallel) = 16 whole experts" in report
    assert f"= {dp_ep.max_concurrency} per replica; 4 replicas: {4 * dp_ep.max_concurrency:,} in all" in report


def test_without_expert_parallel_each_replica_slices_every_expert_over_its_tp():
    assert _plan(data_parallel_size=4, tensor_parallel_size=8).stages[0].params == \
        _plan(tensor_parallel_size=8).stages[0].params


def _plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "plan", str(CONFIG), *args],
                          capture_output=True, text=True, timeout=120)


def test_the_32_card_cluster_side_by_side():
    run = _plan_cli("--max-model-len", "32768", "--compare", "tp8-pp4", "dp4-tp8-ep")
    assert run.returncode == 0, run.stderr
    rows = {line[:41].strip(): line[41:].split() for line in run.stdout.splitlines()[2:]}
    tp_pp, dp_ep = _plan(tensor_parallel_size=8, pipeline_parallel_size=4), \
        _plan(data_parallel_size=4, tensor_parallel_size=8, enable_expert_parallel=True)
    assert rows["cards"] == ["32", "32"]
    assert rows["experts per card (per MoE layer)"] == ["all", "512,", "1/8", "of", "each", "16", "whole"]
    assert rows["KV tokens per replica"] == [f"{tp_pp.cache_tokens:,}", f"{dp_ep.cache_tokens:,}"]
    assert rows["replicas"] == ["1", "4"]
    assert rows["sequences, all replicas"] == [f"{tp_pp.max_concurrency:,}", f"{4 * dp_ep.max_concurrency:,}"]


@pytest.mark.parametrize("args,message", [
    (("-dp", "3", "-tp", "8", "--enable-expert-parallel"), "among the 24 expert-parallel ranks (--data-parallel-size "
                                                           "3 x --tensor-parallel-size 8), but 24 does not divide 512"),
    (("--compare", "tp8-xp4"), "--compare 'tp8-xp4': each layout is dash-separated tpN, ppN, dpN and ep"),
])
def test_layouts_that_cannot_run_exit_2_naming_the_flags(args, message):
    run = _plan_cli(*args)
    assert run.returncode == 2 and message in run.stderr, run.stderr
