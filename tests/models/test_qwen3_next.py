"""Qwen3-Next (Qwen3.5's hybrid layers, Gated DeltaNet projections packed per key-head group, MoE
outside mlp_only_layers) matches HF transformers on a tiny random fp32 checkpoint whose config.json
has the released shape (no layer_types: full_attention_interval; rope_theta and
partial_rotary_factor at the top level): under chunked prefill, preemption and prefix-cache hits, and over a
64-token decode, with the top-k routing weights renormalised (norm_topk_prob, as released) or not;
and at TP 2 and PP 2."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tengyun import LLM, SamplingParams
from tengyun.config import EngineConfig
from tengyun.models.qwen3_next import split_ba, split_qkvz
from conftest import QWEN3_5_MOE, QWEN3_5_TEXT, randomize_norms_and_routers
from test_hf_parity import TOP_K, _prompts
from test_qwen3_5 import (
    _assert_matches, _hf_reference, assert_64_token_decode_matches, assert_batch_matches_under_preemption,
)

# 4 layers: Gated DeltaNet, gated attention, twice (interval 2, not the default 4, so the
# interval must be read); layer 0 a dense MLP, layers 1-3 MoE (8 experts, top-2, shared expert);
# 2 key / 4 value linear heads, so the per-key-head interleaving of in_proj_qkvz / in_proj_ba matters.
NEXT = dict(QWEN3_5_TEXT, **QWEN3_5_MOE, mlp_only_layers=[0], decoder_sparse_step=1)
INTERVAL = 2


def _hf_model(norm_topk_prob: bool = True, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3NextConfig(**NEXT, norm_topk_prob=norm_topk_prob, full_attention_interval=INTERVAL)
    return randomize_norms_and_routers(transformers.Qwen3NextForCausalLM(config)).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer_dir) -> dict:
    """norm_topk_prob -> checkpoint folder."""
    folders = {}
    for norm_topk_prob in (True, False):
        folder = folders[norm_topk_prob] = tmp_path_factory.mktemp("tiny_qwen3_next")
        _hf_model(norm_topk_prob).save_pretrained(folder)
        for f in tiny_tokenizer_dir.iterdir():
            shutil.copy(f, folder / f.name)
        config_file = folder / "config.json"
        cfg = json.loads(config_file.read_text())
        assert cfg["layer_types"] == ["linear_attention", "full_attention"] * 2
        rope = cfg.pop("rope_parameters")
        del cfg["layer_types"]  # as Qwen/Qwen3-Next-80B-A3B-Instruct's config.json
        cfg.update(full_attention_interval=INTERVAL, rope_theta=rope["rope_theta"],
                   partial_rotary_factor=rope["partial_rotary_factor"], rope_scaling=None)
        config_file.write_text(json.dumps(cfg))
    return folders


@pytest.fixture(params=[True, False], ids=["norm_topk_prob", "raw_topk"])
def checkpoint(request, checkpoints):
    """(norm_topk_prob, folder)."""
    return request.param, checkpoints[request.param]


def test_unpacked_projections_give_hf_query_key_value_z_b_a():
    layer = _hf_model().model.layers[0].linear_attn
    x = torch.randn(3, 1, NEXT["hidden_size"])
    with torch.no_grad():
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
        qkv_w, z_w = split_qkvz(layer.in_proj_qkvz.weight, num_k_heads=2, k_dim=8, group_v=16)
        b_w, a_w = split_ba(layer.in_proj_ba.weight, num_k_heads=2)
        expected_qkv = torch.cat([t.flatten(-2) for t in (q, k, v)], dim=-1)  # all q | all k | all v
        torch.testing.assert_close(x @ qkv_w.T, expected_qkv, rtol=0, atol=1e-6)
        torch.testing.assert_close(x @ z_w.T, z.flatten(-2), rtol=0, atol=1e-6)
        torch.testing.assert_close(x @ b_w.T, b, rtol=0, atol=1e-6)
        torch.testing.assert_close(x @ a_w.T, a, rtol=0, atol=1e-6)


def test_config_without_layer_types_is_hybrid_from_full_attention_interval(checkpoints):
    config = EngineConfig(str(checkpoints[True]), dtype="float32").finalize()
    assert config.model_spec.layer_types == ("linear_attention", "full_attention") * 2
    assert config.architecture == "Qwen3NextForCausalLM"
    assert config.enable_prefix_caching  # on by default: hits restore the recurrent state too


def test_greedy_matches_hf_under_chunked_prefill_and_preemption(checkpoint):
    norm_topk_prob, folder = checkpoint
    engine = assert_batch_matches_under_preemption(_hf_model(norm_topk_prob), folder)
    assert engine.get_stats().prefix_cache_hits > 0  # four prompts share 40 tokens: hybrid hits


def test_single_sequence_decode_of_64_tokens_matches_hf(checkpoint):
    norm_topk_prob, folder = checkpoint
    assert_64_token_decode_matches(_hf_model(norm_topk_prob), folder)


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_tp_and_pp_ranks_split_the_unpacked_projections_and_match_hf(checkpoints, parallel):
    """TP 2: each rank keeps one key head (and its two value heads) of in_proj_qkv / in_proj_z /
    in_proj_b / in_proj_a unpacked from the full checkpoint tensors; PP 2: one of each layer type per stage."""
    prompts = _prompts(300)[:6]
    reference = _hf_reference(_hf_model(), prompts, 8)
    llm = LLM(str(checkpoints[True]), dtype="float32", block_size=8, max_model_len=104, kv_cache_memory="1MiB",
              max_num_batched_tokens=32, **parallel)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=TOP_K)
    try:
        _assert_matches(llm.generate(prompts, params), reference)
    finally:
        llm.llm_engine.shutdown()
