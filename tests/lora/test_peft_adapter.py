"""PEFT folders checked without torch: scaling from r / lora_alpha / use_rslora, and each adapter
Tengyun cannot serve refused with a message naming the adapter, the module and the fix."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import read_config
from tengyun.config import EngineConfig
from tengyun.lora.modules import LoRAModulePath, parse_lora_modules
from tengyun.lora.peft_adapter import LoRAAdapterError, read_peft_adapter
from tengyun.lora.request import LoRARequest
from tengyun.model_spec import ModelSpec

# the tiny checkpoints: hidden 64, 4 heads x 16, 2 KV heads, intermediate 128, 2 layers
SHAPES = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
          "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}
PARENT = {m: "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp" for m in SHAPES}


@pytest.fixture(scope="module")
def spec(tiny_checkpoints) -> ModelSpec:
    return ModelSpec.from_hf_config(read_config(tiny_checkpoints["llama"]))


def _adapter(folder, r=4, alpha=8, modules=("q_proj", "v_proj", "down_proj"), tensors=None, **config):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(modules), **config}))
    if tensors is None:
        tensors = {}
        for module in (m for m in modules if m in SHAPES):
            in_, out = SHAPES[module]
            key = f"base_model.model.model.layers.0.{PARENT[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = np.zeros((r, in_), np.float32)
            tensors[f"{key}.lora_B.weight"] = np.zeros((out, r), np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return LoRARequest("sql", 1, str(folder))


def test_scaling_is_alpha_over_r_or_over_sqrt_r_with_rslora(tmp_path, spec):
    plain = read_peft_adapter(_adapter(tmp_path / "a", r=4, alpha=8), spec, 16)
    assert plain.rank == 4 and plain.scaling == 2.0 and len(plain.modules) == 3
    rslora = read_peft_adapter(_adapter(tmp_path / "b", r=4, alpha=8, use_rslora=True), spec, 16)
    assert rslora.scaling == pytest.approx(8 / math.sqrt(4))


@pytest.mark.parametrize("change, words", [
    (dict(r=32), ["LoRA rank 32 is greater than max_lora_rank 16", "--max-lora-rank 32"]),
    (dict(modules_to_save=["lm_head"]), ["only supports modules_to_save being None", "modules_to_save ['lm_head']"]),
    (dict(modules=("q_proj", "lm_head")), ["target module 'lm_head'"]),
    (dict(use_dora=True), ["does not yet support DoRA (use_dora)"]),
    (dict(bias="all"), ["Adapter bias cannot be used without bias_enabled", "bias 'all'"]),
    (dict(tensors={"base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((4, 8), np.float32)}),
     ["model.embed_tokens.lora_embedding_A is not a lora_A / lora_B"]),
    (dict(tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((4, 64), np.float32),
                   "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros((48, 4), np.float32)}),
     ["model.layers.0.self_attn.q_proj.lora_B is [48, 4] but the base model needs [64, 4]"]),
    (dict(tensors={"base_model.model.model.layers.5.mlp.up_proj.lora_A.weight": np.zeros((4, 64), np.float32),
                   "base_model.model.model.layers.5.mlp.up_proj.lora_B.weight": np.zeros((128, 4), np.float32)}),
     ["layer 5, but the base model has 2 layers"]),
])
def test_an_adapter_tengyun_cannot_serve_is_refused_naming_adapter_and_module(tmp_path, spec, change, words):
    with pytest.raises(LoRAAdapterError) as error:
        read_peft_adapter(_adapter(tmp_path, **change), spec, 16)
    assert "LoRA adapter 'sql'" in str(error.value)
    for word in words:
        assert word in str(error.value)


def test_a_pickled_adapter_is_refused_naming_safetensors(tmp_path, spec):
    lora = _adapter(tmp_path)
    (tmp_path / "adapter_model.safetensors").rename(tmp_path / "adapter_model.bin")
    with pytest.raises(LoRAAdapterError, match="adapter_model.bin .*safe_serialization=True"):
        read_peft_adapter(lora, spec, 16)


def test_lora_modules_take_name_equals_path_and_vllms_json_form():
    assert parse_lora_modules(["sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "qwen"}']) == [
        LoRAModulePath("sql", "/a/sql"), LoRAModulePath("chat", "/a/chat", "qwen")]
    with pytest.raises(ValueError, match="names an adapter twice"):
        parse_lora_modules(["a=/x", "a=/y"])


@pytest.mark.parametrize("flags, words", [
    (dict(max_loras=4, max_cpu_loras=2), "--max-cpu-loras (2) must be >= --max-loras (4)"),
    (dict(max_lora_rank=0), "--max-lora-rank must be >= 1"),
])
def test_lora_flags_are_checked_naming_the_flag(flags, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig("m", enable_lora=True, **flags)


@pytest.mark.parametrize("flags, words", [
    (dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}'), "--speculative-config with --enable"),
    (dict(fully_sharded_loras=True, tensor_parallel_size=2), "--fully-sharded-loras is not supported"),
])
def test_what_lora_cannot_run_with_is_refused_at_start_naming_the_flag(tiny_checkpoints, flags, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(str(tiny_checkpoints["llama"]), enable_lora=True, **flags).finalize()


def test_enable_lora_on_a_model_it_cannot_run_names_the_flag(tiny_checkpoints):
    with pytest.raises(ValueError, match="--enable-lora: LoRA adapters run on .*Qwen3MoeForCausalLM"):
        EngineConfig(str(tiny_checkpoints["qwen3_moe"]), enable_lora=True).finalize()
