"""Pipeline stages split by work (sizing/pp_layers.py), or by VLLM_PP_LAYER_PARTITION."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tengyun.config import EngineConfig
from tengyun.entrypoints.llm import LLM
from tengyun.model_spec import ModelSpec
from tengyun.ops.plan import report_lines, smallest_fit
from tengyun.sampling_params import SamplingParams
from tengyun.sizing.pp_layers import balanced_partition, layer_cost, pp_layer_partition
from tengyun.sizing.plan import Cards, make_plan
from tengyun.sizing.resolve import resolve_sizing

GIB = 2**30
QWEN3_0_6B = Path(__file__).parents[1] / "fixtures" / "ops" / "qwen3_0_6b" / "config.json"


def test_the_last_stage_carries_the_lm_head_so_it_holds_fewer_layers():
    spec = ModelSpec.from_hf_config(json.loads(QWEN3_0_6B.read_text()))
    head = spec.vocab_size * spec.hidden_size
    assert 9 < head / layer_cost(spec, 0) < 10  # Qwen3-0.6B: the head multiplies ~10 layers' weights per token
    counts = balanced_partition(spec, 2)
    assert counts == (19, 9) and sum(counts) == spec.num_layers
    # the slowest stage paces the pipeline: 19 layers vs 9 + the head, against 14 + head for the even split
    assert max(19, 9 + head / layer_cost(spec, 0)) < 14 + head / layer_cost(spec, 0)
    assert balanced_partition(spec, 4) == (9, 9, 9, 1)


def test_a_tied_tiny_model_without_a_heavy_head_splits_evenly_where_the_work_is_even(tiny_checkpoints):
    spec = EngineConfig(model=str(tiny_checkpoints["llama"])).finalize().model_spec
    assert balanced_partition(spec, 2) == (1, 1)  # two layers: one each, whatever the head costs


def test_vllm_pp_layer_partition_sets_the_split_and_is_checked(monkeypatch):
    spec = ModelSpec.from_hf_config(json.loads(QWEN3_0_6B.read_text()))
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "14,14")
    assert pp_layer_partition(spec, 2) == (14, 14)
    for bad in ("14,13", "28", "a,b", "0,28"):
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", bad)
        with pytest.raises(ValueError, match=r"VLLM_PP_LAYER_PARTITION=.* must list 2 positive layer counts.*"
                                             r"add up to num_hidden_layers 28 \(e.g. 19,9\)"):
            pp_layer_partition(spec, 2)
    assert pp_layer_partition(spec, 1) is None


def test_plan_shows_the_stages_the_engine_builds():
    hf = json.loads(QWEN3_0_6B.read_text())
    settings = EngineConfig(pipeline_parallel_size=2, kv_cache_memory=2**30)
    plan = make_plan(hf, resolve_sizing(settings, ModelSpec.from_hf_config(hf), "cpu"))
    assert [s.layers for s in plan.stages] == [(0, 19), (19, 28)]
    text = "\n".join(report_lines(plan, None))
    assert "Layers per stage: 19 / 9 (balanced by the weights a decode step reads" in text


def test_pp2_with_an_uneven_split_generates_what_pp1_does(tiny_hybrid_checkpoints, monkeypatch):
    """Qwen3.5 (4 layers: three Gated DeltaNet, one attention) split 3 + 1 across real gloo processes."""
    folder = str(tiny_hybrid_checkpoints["qwen3_5"])
    prompts = [[(7 * i + j) % 300 + 5 for j in range(12 + 5 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    args = dict(dtype="float32", kv_cache_memory="4MiB", max_model_len=128, max_num_seqs=4)
    reference = [o.outputs[0].token_ids for o in LLM(folder, **args).generate(prompts, params)]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,1")
    llm = LLM(folder, pipeline_parallel_size=2, **args)
    assert llm.llm_engine.config.model_spec.pp_layers == (3, 1)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference
    llm.llm_engine.shutdown()


def test_the_smallest_fit_is_searched_with_the_stages_the_engine_would_build():
    hf = json.loads(QWEN3_0_6B.read_text())
    spec = ModelSpec.from_hf_config(hf)
    cards = Cards(memory=GIB, per_node=1)  # 1 GiB cards, TP 1: only pipeline stages can spread the weights
    settings = dict(max_model_len=4096, max_num_seqs=4, tensor_parallel_size=1)
    tp, pp = smallest_fit(hf, resolve_sizing(EngineConfig(**settings), spec, "npu"), cards)
    # The engine at that pp balances its stages; planned that way, it fits, and one stage fewer does not.
    at_fit = make_plan(hf, resolve_sizing(EngineConfig(**settings, pipeline_parallel_size=pp), spec, "npu"), cards)
    assert at_fit.fits and [s.layers[1] - s.layers[0] for s in at_fit.stages] == list(balanced_partition(spec, pp))
    fewer = make_plan(hf, resolve_sizing(EngineConfig(**settings, pipeline_parallel_size=pp - 1), spec, "npu"), cards)
    assert (tp, pp > 1, fewer.fits) == (1, True, False)
