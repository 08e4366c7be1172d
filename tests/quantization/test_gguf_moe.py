"""Qwen3-MoE .gguf files, dequantized and kept quantised: tiny random Qwen3-MoE checkpoints written
as llama.cpp lays a .gguf out (gguf_files.py: blk.N.ffn_{gate,up,down}_exps [E, rows, cols],
tokenizer.ggml.*, blocks from the gguf package's own quantize), read back through transformers'
GGUF reader, give HF's greedy tokens on the fp32 twin that holds the gguf package's dequantized
weights."""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("gguf", reason="the gguf package is not installed")
from conftest import make_tiny_checkpoint  # noqa: E402
from gguf_files import write_gguf  # noqa: E402
from test_gguf import _plan, assert_read_as_transformers_reads  # noqa: E402
from test_quantized_models import _hf_greedy, _prompts, _tengyun  # noqa: E402

from tengyun import LLM, SamplingParams  # noqa: E402

from tengyun.models.model_source import converted_dir  # noqa: E402

# Experts as llama.cpp's Q4_K_M mixes them (gate/up one type, down another), in the types a
# 64-wide tiny model can hold (32-weight blocks); attention and the router stay F32.
EXPERT_TYPES = {"ffn_gate_exps.weight": "Q8_0", "ffn_up_exps.weight": "Q8_0", "ffn_down_exps.weight": "Q4_0"}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch):
    """Conversions of these throw-away files go to a test folder, not the user's cache."""
    monkeypatch.setenv("TENGYUN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "gguf_moe_cache"))


@pytest.fixture(scope="module")
def moe_gguf(tiny_tokenizer_dir, tmp_path_factory):
    """(the .gguf, the dequantized HF twin): every layer sparse (llama.cpp's qwen3moe has no dense
    layers), an expert width (32) other than Qwen3MoeConfig's default 768."""
    root = tmp_path_factory.mktemp("gguf_moe")
    hf = make_tiny_checkpoint(root / "hf", tiny_tokenizer_dir, "qwen3_moe", mlp_only_layers=[])
    path = write_gguf(hf, root / "tiny-moe.gguf", EXPERT_TYPES, twin=root / "twin")
    return path, root / "twin"


@pytest.fixture(scope="module")
def hf_tokens(moe_gguf):
    return _hf_greedy(moe_gguf[1], _prompts())


def test_a_moe_gguf_dequantized_gives_hf_greedy_tokens_and_its_expert_width(moe_gguf, hf_tokens):
    """transformers' GGUF config mapping leaves qwen3moe.expert_feed_forward_length out (so its
    own reader gives moe_intermediate_size 768); the conversion reads it from the file."""
    path, _ = moe_gguf
    assert [o.token_ids for o in _tengyun(path)] == hf_tokens
    assert json.loads((converted_dir(path) / "config.json").read_text())["moe_intermediate_size"] == 32


def test_moe_experts_kept_quantised_give_hf_greedy_tokens(moe_gguf, hf_tokens):
    path, _ = moe_gguf
    assert [o.token_ids for o in _tengyun(path, quantization="gguf")] == hf_tokens
    types = json.loads((converted_dir(path, True) / "config.json").read_text())["quantization_config"]["tensor_types"]
    assert types == {f"model.layers.{n}.mlp.experts.0.{proj}_proj": t for n in (0, 1)
                     for proj, t in (("gate", "Q8_0"), ("up", "Q8_0"), ("down", "Q4_0"))}


@pytest.mark.parametrize("keep_quantized", [True, False])
def test_a_moe_gguf_is_read_tensor_by_tensor_as_the_full_load_reads_it(moe_gguf, monkeypatch, keep_quantized):
    """One expert stack at a time, never the model's float32: transformers' processor stacks gate
    and up into experts.gate_up_proj once both are read; kept experts come one per expert."""
    path, _ = moe_gguf
    kept = assert_read_as_transformers_reads(monkeypatch, path, keep_quantized)
    if keep_quantized:
        assert {m: t for m, t in kept.items() if ".experts." in m} == {
            f"model.layers.{n}.mlp.experts.0.{proj}_proj": t for n in (0, 1)
            for proj, t in (("gate", "Q8_0"), ("up", "Q8_0"), ("down", "Q4_0"))}


def test_kept_experts_hold_their_blocks_one_scheme_per_stack(moe_gguf):
    """gate/up (w13) Q8_0 and down (w2) Q4_0 in one MoE block, no dense expert weight left, and
    `tengyun plan` counts exactly the bytes the worker holds (float32 and bfloat16). In bfloat16,
    where the compiled kernels run, each stack runs as one grouped call (no host read); float32's
    dequantizing reference loops over the experts."""
    from tengyun.config import EngineConfig
    from tengyun.platforms.cpu.kernels.quant_layout import quant_gemv_fits
    from tengyun.worker.worker import Worker, weight_bytes

    path, _ = moe_gguf
    for dtype in ("float32", "bfloat16"):
        config = EngineConfig(str(path), quantization="gguf", dtype=dtype, kv_cache_memory="1MiB", max_model_len=128)
        worker = Worker(config.finalize())
        experts = worker.model.model.layers[0].mlp.experts
        assert {p: s.kernel for p, s in experts.schemes.items()} == {"w13": "gguf_q8_0", "w2": "gguf_q4_0"}
        assert not hasattr(experts, "w13_weight") and not hasattr(experts, "w2_weight")
        assert experts.quant_grouped == (dtype == "bfloat16" and quant_gemv_fits())
        plan = _plan(path, "--quantization", "gguf", "--device", "cpu", "--dtype", dtype)
        assert plan["stages"][0]["weight_bytes"] == weight_bytes(worker.model), dtype


def test_kept_experts_in_bfloat16_follow_the_dequantized_bfloat16_run(moe_gguf):
    """bfloat16 runs the CPU's GGUF kernels per expert on the exact dequantized weights; the .gguf
    loaded dequantized to bfloat16 (its weights rounded to bfloat16) is the reference. The two
    differ by that rounding (logprobs up to ~0.08 apart measured), so on this tiny model's flat
    distributions a greedy token can flip at a near-tie: each step is compared teacher-forced
    instead, the reference's prompt and answer fed to the kept engine (prompt_logprobs), every
    answer token's logprob within 0.2 of the reference's; within 0.3 where the compiled quant kernel
    does not run (AVX2 cores: torch's int4 matmul per expert), where 0.264 was measured (2026-12-07,
    AMD EPYC without AVX-512, token 3 of a prompt; the same with F.linear for the dense layers)."""
    from tengyun.platforms.cpu.kernels.quant_layout import quant_gemv_fits

    tolerance = 0.2 if quant_gemv_fits() else 0.3
    path, _ = moe_gguf
    dense = _tengyun(path, dtype="bfloat16")
    llm = LLM(str(path), quantization="gguf", dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=128)
    try:
        forced = llm.generate([p + list(o.token_ids) for p, o in zip(_prompts(), dense)],
                              SamplingParams(max_tokens=1, prompt_logprobs=0))
    finally:
        llm.llm_engine.shutdown()
    for prompt, reference, out in zip(_prompts(), dense, forced):
        for i, token in enumerate(reference.token_ids):
            kept = out.prompt_logprobs[len(prompt) + i][token].logprob
            assert abs(kept - reference.logprobs[i][token].logprob) < tolerance, (i, token)


def test_kept_experts_under_tp2_over_gloo_give_the_single_process_tokens(moe_gguf, hf_tokens):
    """Each rank holds 4 of the 8 experts' blocks whole."""
    path, _ = moe_gguf
    assert [o.token_ids for o in _tengyun(path, quantization="gguf", tensor_parallel_size=2)] == hf_tokens


def test_experts_whose_gate_and_up_types_differ_load_dense_and_say_so(tiny_tokenizer_dir, tmp_path, caplog):
    """Tengyun stacks an expert's gate and up rows as one layer of one type: a .gguf that stores
    them in two types keeps that layer's experts dense (dequantized), the rest quantised."""
    hf = make_tiny_checkpoint(tmp_path / "hf", tiny_tokenizer_dir, "qwen3_moe", mlp_only_layers=[])
    types = {**EXPERT_TYPES, "blk.0.ffn_up_exps.weight": "Q4_1"}
    path = write_gguf(hf, tmp_path / "mixed.gguf", types, twin=tmp_path / "twin")
    with caplog.at_level(logging.INFO, logger="tengyun.models.gguf_quantized"):
        tokens = [o.token_ids for o in _tengyun(path, quantization="gguf")]
    assert tokens == _hf_greedy(tmp_path / "twin", _prompts())
    assert "blk.0.ffn_gate_exps.weight Q8_0, blk.0.ffn_up_exps.weight Q4_1" in caplog.text
    kept = json.loads((converted_dir(path, True) / "config.json").read_text())["quantization_config"]["tensor_types"]
    assert "model.layers.0.mlp.experts.0.gate_proj" not in kept
    assert kept["model.layers.0.mlp.experts.0.down_proj"] == "Q4_0"  # down stays a stack of its own
