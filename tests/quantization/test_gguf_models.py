"""GGUF kept quantised end to end on tiny random models (fp32): folders in the layout a .gguf
converts into (tengyun/quantization/gguf.py), their blocks written by the gguf package's own
quantize (Q8_0, Q4_0, Q4_1 mixed per layer), give HF's greedy tokens on an fp32 twin holding the
gguf package's dequantized weights, and TP=2 over gloo gives the single process's tokens."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed")
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize  # noqa: E402
from test_quantized_models import _hf_greedy, _prompts, _tengyun  # noqa: E402

from tengyun.quantization.gguf import GGML_TYPES, quantization_config  # noqa: E402

# Per decoder layer: (q/k/v, o, gate/up, down) types; fused layers share one.
LAYER_TYPES = [("Q4_0", "Q8_0", "Q4_1", "Q4_0"), ("Q8_0", "Q4_1", "Q4_0", "Q8_0")]
_PROJ = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3}
# The embedding and LM head as a .gguf stores them (token_embd, output): rows by token.
VOCAB_TYPES = {"model.embed_tokens.weight": "Q4_1", "lm_head.weight": "Q8_0"}


def _kept_and_twin(dense, kept, twin, layer_types=LAYER_TYPES, module_types=None):
    """``dense`` (an fp32 HF folder) -> ``kept`` (each decoder linear weight as gguf-quantized
    ``qweight`` blocks, config.json naming the types; a type None: left dense) and ``twin`` (dense,
    the blocks dequantized). ``module_types``: {module: type or None} in place of ``layer_types``."""
    tensors = load_file(dense / "model.safetensors")
    kept_tensors, twin_tensors, types = {}, {}, {}
    for name, tensor in tensors.items():
        parts = name.split(".")  # model.layers.L.self_attn.q_proj.weight
        layer = name.startswith("model.layers.") and parts[-1] == "weight" and parts[-2] in _PROJ
        type_name = layer_types[int(parts[2]) % len(layer_types)][_PROJ[parts[-2]]] if layer else VOCAB_TYPES.get(name)
        type_name = (module_types or {}).get(name.removesuffix(".weight"), type_name)
        if type_name is not None:
            qtype = gguf.GGMLQuantizationType[type_name]
            blocks = gguf_quantize(tensor.float().numpy(), qtype)  # uint8 [out, in / 32 * block bytes]
            module = name.removesuffix(".weight")
            kept_tensors[f"{module}.qweight"] = torch.from_numpy(blocks).reshape(
                tensor.shape[0], -1, GGML_TYPES[type_name].block_bytes)
            twin_tensors[name] = torch.from_numpy(gguf_dequantize(blocks, qtype).copy())
            types[module] = type_name
        else:
            kept_tensors[name] = twin_tensors[name] = tensor
    config = json.loads((dense / "config.json").read_text())
    for folder, folder_tensors, section in ((kept, kept_tensors, quantization_config("tiny.gguf", types)),
                                            (twin, twin_tensors, None)):
        shutil.copytree(dense, folder)
        save_file({k: v.contiguous() for k, v in folder_tensors.items()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": section} if section
                                                       else config))
    return kept, twin


@pytest.fixture(scope="module")
def kept_models(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf_kept")
    return {arch: _kept_and_twin(tiny_checkpoints[arch], out / arch, out / f"{arch}_twin")
            for arch in ("llama", "qwen2")}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_kept_blocks_give_hf_greedy_tokens_on_the_dequantized_twin(kept_models, arch):
    kept, twin = kept_models[arch]
    assert [o.token_ids for o in _tengyun(kept)] == _hf_greedy(twin, _prompts())


# llama.cpp's Q4_K_M in miniature: fused layers whose modules differ in type, one of them dense.
MIXED = {"model.layers.1.self_attn.q_proj": "Q4_1", "model.layers.1.self_attn.k_proj": "Q4_1",
         "model.layers.1.self_attn.v_proj": "Q8_0", "model.layers.0.mlp.gate_proj": "Q4_0",
         "model.layers.0.mlp.up_proj": None}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_layers_mixing_types_run_each_module_with_its_own_and_give_hf_tokens(tiny_checkpoints, tmp_path, arch):
    """q/k/v (qwen2: with its fused bias) and gate/up stored in different types run as shards of
    their fused layer (LinearBase.use_shard_schemes), as vLLM's GGUF linear does; under TP=2 too."""
    kept, twin = _kept_and_twin(tiny_checkpoints[arch], tmp_path / "kept", tmp_path / "twin", module_types=MIXED)
    types = json.loads((kept / "config.json").read_text())["quantization_config"]["tensor_types"]
    assert types["model.layers.1.self_attn.v_proj"] == "Q8_0" and "model.layers.0.mlp.up_proj" not in types
    tokens = [o.token_ids for o in _tengyun(kept)]
    assert tokens == _hf_greedy(twin, _prompts())
    if arch == "llama":  # column-parallel shards: q heads, k/v heads and gate rows split per rank
        assert [o.token_ids for o in _tengyun(kept, tensor_parallel_size=2)] == tokens


def test_a_dense_fused_layer_among_kept_blocks_gives_hf_tokens(tiny_checkpoints, tmp_path):
    """A fused layer left dense (both modules), beside quantised layers and a quantised embedding
    and head: here layer 1's gate/up."""
    mixed = [LAYER_TYPES[0], (*LAYER_TYPES[1][:2], None, LAYER_TYPES[1][3])]
    kept, twin = _kept_and_twin(tiny_checkpoints["llama"], tmp_path / "kept", tmp_path / "twin", mixed)
    assert "model.layers.1.mlp.gate_proj" not in json.loads((kept / "config.json").read_text())[
        "quantization_config"]["tensor_types"]
    assert [o.token_ids for o in _tengyun(kept)] == _hf_greedy(twin, _prompts())


def test_a_tied_kept_head_on_a_last_pipeline_stage_gives_the_single_process_tokens(kept_models):
    """qwen2 (tied): under PP=2 the last stage has no embedding to share, so its head loads the
    embedding's blocks (model.embed_tokens.qweight) as its own."""
    kept, _ = kept_models["qwen2"]
    single = [o.token_ids for o in _tengyun(kept)]
    assert [o.token_ids for o in _tengyun(kept, pipeline_parallel_size=2)] == single


def test_kept_blocks_under_tp2_over_gloo_give_the_single_process_tokens(kept_models):
    kept, _ = kept_models["llama"]  # row-parallel o_proj / down_proj: 32 / 64 inputs per rank, whole blocks
    single = [o.token_ids for o in _tengyun(kept)]
    assert [o.token_ids for o in _tengyun(kept, tensor_parallel_size=2)] == single


def test_kept_blocks_in_bfloat16_through_torch_npu_start_as_the_cpu_kernels(kept_models, monkeypatch):
    """The tiny Llama in bfloat16 through npu/kernels/gguf.py (on fake_torch_npu's documented semantics)
    runs end to end and starts each answer as the CPU kernels do (torch's int4 matmul, the Q8_0
    reference); later tokens of this random model part on bf16 rounding (measured: after 3)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "platforms"))
    import fake_torch_npu

    from tengyun.platforms.cpu.platform import CpuPlatform
    from tengyun.platforms.npu.kernels.gguf import npu_gguf_kernel

    kept, _ = kept_models["llama"]
    cpu = [o.token_ids for o in _tengyun(kept, dtype="bfloat16")]
    fake = fake_torch_npu.module()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(CpuPlatform, "quant_linear_kernel", lambda self, scheme, dtype: npu_gguf_kernel(scheme, dtype))
    assert [o.token_ids[:3] for o in _tengyun(kept, dtype="bfloat16")] == [tokens[:3] for tokens in cpu]
    assert fake.calls["npu_weight_quant_batchmatmul"] > 0


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_plan_counts_mixed_fused_layers_as_the_engine_holds_their_shards(tiny_checkpoints, tmp_path, dtype):
    """`tengyun plan` counts each shard of a mixed fused layer in its own type, as the engine holds it."""
    from conftest import plan_and_worker

    kept, _ = _kept_and_twin(tiny_checkpoints["llama"], tmp_path / "kept", tmp_path / "twin", module_types=MIXED)
    plan, _, worker = plan_and_worker(kept, dtype)
    qkv = worker.model.model.layers[1].self_attn.qkv_proj
    assert [shard.scheme.kernel if shard.scheme else None for shard in qkv.shards] == ["gguf_q4_1"] * 2 + ["gguf_q8_0"]
    assert plan.stages[0].weight_bytes == worker.weight_bytes
