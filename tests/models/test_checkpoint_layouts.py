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


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout_folders(request, tmp_path_factory, tiny_tokenizer_dir):
    """(layout name, checkpoint folder, the folder HF loads as the reference)."""
    folder = tmp_path_factory.mktemp(request.param) / "checkpoint"
    return request.param, folder, write_layout(folder, tiny_tokenizer_dir, LAYOUTS[request.param])


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
        llm = LLM(str(folder), block_size=8, max_model_len=128, kv_cache_memory="1MiB", max_num_batched_tokens=32)
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
