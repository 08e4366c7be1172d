"""The Ascend path without an NPU: platform selection and errors, the block-size default, and
the NPU attention backend's and layer ops' calls checked against a CPU reference of the
documented torch_npu ops (tests/platforms/fake_torch_npu.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tengyun import LLM, SamplingParams
from tengyun.config import EngineConfig
from tengyun.platforms.attention_backends import get_attention_backend
from tengyun.layers.attention.layer import Attention
from tengyun.layers.layer_ops import TORCH_LAYER_OPS
from tengyun.layers.layernorm import RMSNorm
from tengyun.layers.rotary_embedding import RotaryEmbedding
from tengyun.platforms import get_platform
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.platforms.npu.platform import NpuPlatform

sys.path.insert(0, str(Path(__file__).parent))
import fake_torch_npu  # noqa: E402


def test_npu_without_torch_npu_is_an_error_naming_set_env(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch_npu" else real(name, *a))
    with pytest.raises(RuntimeError, match="set_env.sh"):
        get_platform("npu")
    assert get_platform("auto").device_type in ("cpu", "cuda")


def test_block_size_defaults_to_the_platforms(tiny_checkpoints, monkeypatch):
    assert NpuPlatform.default_block_size == 128 and NpuPlatform().attention_backend() == "npu"
    assert EngineConfig(model=str(tiny_checkpoints["llama"])).finalize().block_size == 16
    monkeypatch.setattr(CpuPlatform, "default_block_size", 128)  # stands in for an NPU host
    assert EngineConfig(model=str(tiny_checkpoints["llama"])).finalize().block_size == 128
    assert EngineConfig(model=str(tiny_checkpoints["llama"]), block_size=32).finalize().block_size == 32


def test_npu_settings_problem_names_the_flag_and_the_value_to_use():
    assert NpuPlatform.settings_problem(128, "bfloat16", "bfloat16") is None
    assert NpuPlatform.settings_problem(512, "float16", "auto") is None
    assert NpuPlatform.settings_problem(16, "bfloat16", "bfloat16") == (
        "--block-size 16: torch_npu's paged attention takes blocks of 128-512 tokens in multiples of 128 for a "
        "prompt's tokens: use --block-size 128 (the NPU default)")
    for size in (8, 64, 192, 640):
        assert NpuPlatform.settings_problem(size, "bfloat16", "bfloat16").startswith(f"--block-size {size}:")
    assert NpuPlatform.settings_problem(256, "float32", "float32") == (
        "--dtype float32: torch_npu's attention, KV-cache write and W8A8 ops take float16 or bfloat16 only: "
        "use --dtype bfloat16")
    assert NpuPlatform.settings_problem(128, "bfloat16", "float32").startswith("--kv-cache-dtype float32:")
    assert NpuPlatform.settings_problem(128, "bfloat16", "float32").endswith("use --kv-cache-dtype bfloat16")
    assert CpuPlatform.settings_problem(16, "float32", "float32") is None  # the base: no limits


def test_npu_attention_backend_matches_torch_sdpa(tiny_checkpoints, monkeypatch):
    assert get_attention_backend("npu").name == "npu"  # importable without torch_npu
    prompts = [[5, 6, 7], list(range(1, 60)), list(range(1, 40)) + [9, 9]]  # 59 tokens: chunked over 3 steps
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # bfloat16 and blocks of 128: the op takes 16-bit queries, and a multi-token query needs 128-512
    args = dict(dtype="bfloat16", block_size=128, max_model_len=128, kv_cache_memory="1MiB", max_num_batched_tokens=24)
    reference = [o.outputs[0].token_ids for o in LLM(str(tiny_checkpoints["qwen3"]), **args).generate(prompts, params)]

    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu.module())
    monkeypatch.setattr(CpuPlatform, "attention_backend", lambda self, *args: "npu")
    llm = LLM(str(tiny_checkpoints["qwen3"]), **args)
    layers = [m for m in llm.llm_engine.executor.model.modules() if isinstance(m, Attention)]
    assert {layer.backend.name for layer in layers} == {"npu"}
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference


# plain norms; q/k norms; zero-centred, gated, partial rotary
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
def test_npu_layer_ops_match_the_pytorch_path(arch, request, monkeypatch):
    from tengyun.platforms.npu.kernels.layer_ops import NpuLayerOps

    checkpoints = request.getfixturevalue("tiny_hybrid_checkpoints" if arch == "qwen3_5" else "tiny_checkpoints")
    folder = str(checkpoints[arch])
    prompts = [[5, 6, 7], list(range(1, 60)), list(range(1, 40)) + [9, 9]]  # 59 tokens: chunked over 3 steps
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    args = dict(dtype="bfloat16", block_size=128, max_model_len=128, kv_cache_memory="1MiB",
                max_num_batched_tokens=24)

    def layers(llm, cls):
        return [m for m in llm.llm_engine.executor.model.modules() if isinstance(m, cls)]

    fake = fake_torch_npu.module()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)  # importable, but the CPU platform does not select it
    monkeypatch.setattr(CpuPlatform, "layer_ops", lambda self: TORCH_LAYER_OPS)  # the reference: PyTorch's ops
    plain = LLM(folder, **args)
    assert {id(m.ops) for m in layers(plain, RMSNorm) + layers(plain, RotaryEmbedding)} == {id(TORCH_LAYER_OPS)}
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert fake.calls == {}

    monkeypatch.setattr(CpuPlatform, "layer_ops", lambda self: NpuLayerOps())
    llm = LLM(folder, **args)
    assert all(isinstance(m.ops, NpuLayerOps) for m in layers(llm, RMSNorm) + layers(llm, RotaryEmbedding))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference
    # cpu_paged takes Llama's qkv projection whole, rotary included (Attention.from_qkv); an NPU
    # host's backend leaves the rotary to the layer ops, as the q/k-norm models do here.
    whole = arch == "llama" and layers(llm, Attention)[0].backend.name == "cpu_paged"
    assert set(fake.calls) == {"npu_rms_norm", "npu_add_rms_norm"} | (set() if whole else {"npu_rotary_mul"})


def test_npu_w8a8_kernels_give_the_cpu_engines_tokens(tiny_checkpoints, tmp_path, monkeypatch):
    """A W8A8 checkpoint through npu_dynamic_quant + npu_quant_matmul (tengyun/platforms/npu/kernels/quant.py)
    gives the CPU kernels' tokens: both sum int8 products exactly and scale in float32."""
    from tengyun.platforms.npu.kernels.quant import npu_quant_kernel
    from tengyun.ops.quantize import quantize_folder

    folder = str(quantize_folder(tiny_checkpoints["qwen2"], tmp_path / "w8a8", "w8a8").out_dir)
    prompts = [[5, 6, 7], list(range(1, 60))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    args = dict(dtype="bfloat16", block_size=128, max_model_len=128, kv_cache_memory="1MiB")
    reference = [o.outputs[0].token_ids for o in LLM(folder, **args).generate(prompts, params)]

    fake = fake_torch_npu.module()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(CpuPlatform, "quant_linear_kernel", lambda self, scheme, dtype: npu_quant_kernel(scheme))
    assert [o.outputs[0].token_ids for o in LLM(folder, **args).generate(prompts, params)] == reference
    assert fake.calls["npu_quant_matmul"] > 0 and fake.calls["npu_dynamic_quant"] == fake.calls["npu_quant_matmul"]
