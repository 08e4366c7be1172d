"""Each published checkpoint layout of Qwen3.5, Qwen3.5-MoE and Qwen3-Next (checkpoint_layouts.py:
the multimodal wrapper with its vision tower and MTP layers, fused and per-expert experts, tied and
untied heads, FP8 block quantization) loads and gives HF transformers' greedy tokens and top-5
logprobs; HF reads the same folder (FP8: its dequantized float32 twin) with no weight missing."""

from __future__ import annotations

import json
import logging

import pytest

from tengyun import LLM, SamplingParams
from checkpoint_layouts import LAYOUTS, write_layout
from test_hf_parity import TOP_K, _prompts
from test_qwen3_5 import _assert_matches, _hf_reference

HF_CLASSES = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
              "qwen3_next": "Qwen3NextForCausalLM"}


@pytest.fixture(scope="module")
def build_layout(tmp_path_factory, tiny_tokenizer_dir):
    """layout name -> (checkpoint folder, the folder HF loads as the reference), each written once."""
    built = {}

    def build(name: str):
        if name not in built:
            folder = tmp_path_factory.mktemp(name) / "checkpoint"
            built[name] = folder, write_layout(folder, tiny_tokenizer_dir, LAYOUTS[name])
        return built[name]

    return build


@pytest.fixture(params=sorted(LAYOUTS))
def layout_folders(request, build_layout):
    """(layout name, checkpoint folder, the folder HF loads as the reference)."""
    return (request.param, *build_layout(request.param))


def _hf_from_folder(family: str, folder):
    import transformers

    model, info = getattr(transformers, HF_CLASSES[family]).from_pretrained(folder, output_loading_info=True)
    assert info["missing_keys"] == set() or info["missing_keys"] == [], info
    return model.eval()


def _stored_names(folder) -> list[str]:
    return list(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])


def test_greedy_tokens_and_logprobs_equal_hf(layout_folders, caplog):
    name, folder, reference = layout_folders
    layout = LAYOUTS[name]
    prompts = _prompts(300)[:4]
    expected = _hf_reference(_hf_from_folder(layout.family, reference), prompts, 8)
    with caplog.at_level(logging.INFO):
        llm = LLM(str(folder), dtype="float32", block_size=8, max_model_len=128, kv_cache_memory="1MiB",
                  max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=TOP_K)
    _assert_matches(llm.generate(prompts, params), expected)

    stored = _stored_names(folder)
    for prefix, why in (("model.visual.", "vision tower"), ("mtp.", "multi-token-prediction layers")):
        count = sum(n.startswith(prefix) for n in stored)
        line = f"Skipping {count} {prefix}* checkpoint tensors: {why}"
        assert caplog.text.count(line) == (1 if count else 0), line
    fp8_line = ("FP8 block-quantized checkpoint (weight_block_size [16, 32]): weights dequantized to float32 "
                "at load, since cpu has no FP8 matmul")
    assert (fp8_line in caplog.text) == layout.fp8


@pytest.mark.parametrize("name, parallel", [("qwen3_5_moe-wrapper-fp8", dict(tensor_parallel_size=2)),
                                            ("qwen3_5_moe-wrapper-fused", dict(pipeline_parallel_size=2))],
                         ids=["fp8-tp2", "fused-pp2"])
def test_tp_and_pp_ranks_load_their_share_of_the_layout(build_layout, name, parallel):
    """TP 2: each rank keeps half the experts (dequantized, per expert) and half the heads; PP 2:
    each stage reads its layers out of the wrapper's names, MTP and vision skipped on both."""
    folder, reference = build_layout(name)
    prompts = _prompts(300)[:4]
    expected = _hf_reference(_hf_from_folder(LAYOUTS[name].family, reference), prompts, 8)
    llm = LLM(str(folder), dtype="float32", block_size=8, max_model_len=104, kv_cache_memory="1MiB",
              max_num_batched_tokens=32,
              **parallel)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=TOP_K)
    try:
        _assert_matches(llm.generate(prompts, params), expected)
    finally:
        llm.llm_engine.shutdown()


def _loaded_tensors(folder):
    """(parameters, bytes) of the tensors the engine loads: no vision, MTP or FP8 scale tensors."""
    from safetensors import safe_open

    params = stored_bytes = 0
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                if name.startswith(("model.visual.", "mtp.")):
                    continue
                tensor = f.get_tensor(name)
                stored_bytes += tensor.numel() * tensor.element_size()
                params += 0 if name.endswith("_scale_inv") else tensor.numel()
    return params, stored_bytes


def test_plan_counts_the_decoder_as_loaded_and_fp8_as_held_and_as_served(layout_folders):
    from tengyun.config import EngineConfig
    from tengyun.model_spec import ModelSpec
    from tengyun.sizing.checkpoint import read_model
    from tengyun.sizing.model_size import total_params
    from tengyun.sizing.plan import make_plan
    from tengyun.sizing.resolve import resolve_sizing

    name, folder, _ = layout_folders
    cfg, checkpoint_bytes, _ = read_model(folder)
    params, stored_bytes = _loaded_tensors(folder)
    assert total_params(cfg) == params  # config.json's text_config, as the checkpoint holds the decoder
    assert checkpoint_bytes == stored_bytes  # the vision tower and MTP layers left out
    sizing = resolve_sizing(EngineConfig(kv_cache_memory=2**20, dtype="float32", block_size=16),
                            ModelSpec.from_hf_config(cfg), "cpu")
    plan = make_plan(cfg, sizing, None, checkpoint_bytes)
    assert plan.weight_scale == 1.0 and plan.stages[0].weight_bytes == plan.stages[0].params.total * 4
    if LAYOUTS[name].fp8:
        assert stored_bytes < params * 4
        assert plan.notes == [f"FP8 block-quantized checkpoint (weight_block_size [16, 32]): it holds "
                              f"{stored_bytes / 2**30:.2f} GiB as stored (FP8 weights, their scales and the "
                              f"unquantized tensors); cpu has no FP8 matmul, so the engine dequantizes it at load and "
                              f"its weights count in float32: {params * 4 / 2**30:.2f} GiB."]
    else:
        assert stored_bytes == params * 4 and plan.notes == []


def test_the_wrappers_tie_word_embeddings_decides_as_in_hf():
    """HF ties Qwen3_5ForConditionalGeneration's head by the wrapper's setting, whatever text_config says."""
    import torch
    import transformers

    from tengyun.model_spec import ModelSpec
    from conftest import QWEN3_5_TEXT

    for wrapper, text in ((True, False), (False, True)):
        config = transformers.Qwen3_5Config(text_config=dict(QWEN3_5_TEXT, tie_word_embeddings=text),
                                            tie_word_embeddings=wrapper)
        with torch.device("meta"):  # the default vision tower is ~0.4B parameters: no memory for it
            model = transformers.Qwen3_5ForConditionalGeneration(config)
        hf_tied = model.lm_head.weight is model.model.language_model.embed_tokens.weight
        config.architectures = ["Qwen3_5ForConditionalGeneration"]
        assert ModelSpec.from_hf_config(json.loads(config.to_json_string())).tie_word_embeddings == hf_tied == wrapper


def test_qwen3_moe_with_fused_experts_matches_hf(tmp_path, tiny_tokenizer_dir):
    """Qwen3-MoE's experts as HF's modules hold them (fused 3-D) load as the per-expert checkpoint does."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import ARCH_CONFIGS, TINY_VOCAB

    fields = dict(ARCH_CONFIGS["qwen3_moe"], vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.3, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields)).eval()
    tensors = model.state_dict()
    assert tuple(tensors["model.layers.0.mlp.experts.gate_up_proj"].shape) == (8, 64, 64)  # [E, 2I, H]
    save_file({n: t.contiguous() for n, t in tensors.items()}, tmp_path / "model.safetensors")
    model.config.architectures = ["Qwen3MoeForCausalLM"]
    model.config.save_pretrained(tmp_path)
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    prompts = _prompts(300)[:4]
    expected = _hf_reference(model, prompts, 8)
    llm = LLM(str(tmp_path), dtype="float32", block_size=8, max_model_len=128, kv_cache_memory="1MiB",
              max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=TOP_K)
    _assert_matches(llm.generate(prompts, params), expected)
