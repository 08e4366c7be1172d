"""One kernel bundle per platform (tengyun/layers/kernels.py): the worker binds the platform's
attention backend, linear kernel, norm/rotary ops and gated-delta-rule kernel to every layer in
one pass; a layer built outside the worker computes with the PyTorch defaults."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tengyun import LLM
from tengyun.layers.activation import SiluAndMul
from tengyun.platforms.cpu import native as cpu_kernels
from tengyun.layers.attention.layer import Attention
from tengyun.platforms.attention_backends import get_attention_backend
from tengyun.layers.attention.torch_sdpa import TorchSDPABackend
from tengyun.layers.embed_head import ParallelLMHead
from tengyun.layers.gated_delta_net import GatedDeltaNet
from tengyun.layers.gated_delta_rule import TorchGatedDeltaRule
from tengyun.layers.kernels import KernelBundle, bind_kernels
from tengyun.layers.layer_ops import TORCH_LAYER_OPS, TorchLayerOps
from tengyun.layers.layernorm import RMSNorm
from tengyun.layers.linear import LinearBase, ReplicatedLinear
from tengyun.layers.linear_kernel import DenseLinearKernel, OneDNNPackedLinearKernel, onednn_available
from tengyun.layers.rotary_embedding import RotaryEmbedding
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.model_spec import ModelSpec

GDN_CONFIG = ModelSpec.from_hf_config(dict(
    hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    rms_norm_eps=1e-6, num_attention_heads=2, num_hidden_layers=1, vocab_size=64))


def _layers(model, cls):
    return [m for m in model.modules() if isinstance(m, cls)]


def test_worker_binds_the_platforms_bundle_to_every_layer(tiny_hybrid_checkpoints, monkeypatch):
    # Fresh objects where the platform would hand out the layers' own defaults, so `is` tells.
    monkeypatch.setattr(CpuPlatform, "layer_ops", lambda self: TorchLayerOps())
    monkeypatch.setattr(CpuPlatform, "gated_delta_rule_kernel", lambda self: TorchGatedDeltaRule())
    worker = LLM(str(tiny_hybrid_checkpoints["qwen3_5"]), block_size=8, max_model_len=64,
                 kv_cache_memory="1MiB").llm_engine.executor
    model, kernels = worker.model, worker.kernels
    assert isinstance(kernels, KernelBundle)
    linears = _layers(model, LinearBase) + _layers(model, ParallelLMHead)
    assert linears and all(m.kernel is kernels.linear for m in linears)
    norms = _layers(model, RMSNorm) + _layers(model, RotaryEmbedding) + _layers(model, SiluAndMul)
    assert norms and all(m.ops is kernels.layer_ops for m in norms)
    assert _layers(model, Attention) and all(m.backend is kernels.attention for m in _layers(model, Attention))
    gdn = _layers(model, GatedDeltaNet)
    assert gdn and all(m.kernel is kernels.gated_delta_rule for m in gdn)


def test_layers_built_outside_the_worker_compute_with_pytorch_defaults():
    linear, norm = ReplicatedLinear(8, 4, True, torch.float32), RMSNorm(8, 1e-6, torch.float32)
    rope = RotaryEmbedding(8, 8, 16, dict(rope_type="default", rope_theta=1e4))
    with torch.device("meta"):
        gdn = GatedDeltaNet(GDN_CONFIG, torch.float32)
    assert isinstance(linear.kernel, DenseLinearKernel) and not isinstance(linear.kernel, OneDNNPackedLinearKernel)
    assert norm.ops is TORCH_LAYER_OPS and rope.ops is TORCH_LAYER_OPS and SiluAndMul().ops is TORCH_LAYER_OPS
    assert isinstance(Attention(2, 8, 1, 0.3).backend, TorchSDPABackend)
    assert isinstance(gdn.kernel, TorchGatedDeltaRule)
    linear.weight.data.normal_()
    linear.bias.data.normal_()
    x = torch.randn(3, 8)
    assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))


@pytest.mark.skipif(not onednn_available(torch.float32), reason="this torch build has no oneDNN linear")
def test_binding_a_repacking_linear_kernel_frees_the_loaded_weight():
    linear = ReplicatedLinear(16, 8, True, torch.float32)
    linear.weight.data.normal_()
    linear.bias.data.normal_()
    x, weight = torch.randn(5, 16), linear.weight.data.clone()
    kernels = CpuPlatform().kernels(torch.float32, 16, "float32")
    assert isinstance(kernels.linear, OneDNNPackedLinearKernel)
    bind_kernels(linear, kernels)
    assert linear.weight.numel() == 0 and linear.kernel_weight is not None
    torch.testing.assert_close(linear(x), F.linear(x, weight, linear.bias))


def test_the_gated_delta_rule_kernel_is_chosen_only_for_linear_attention(monkeypatch):
    asked = []
    monkeypatch.setattr(CpuPlatform, "gated_delta_rule_kernel", lambda self: asked.append(1) or TorchGatedDeltaRule())
    plain = CpuPlatform().kernels(torch.float32, 16, "float32")
    assert plain.gated_delta_rule is None and not asked
    built = cpu_kernels.load_error() is None  # the compiled kernels once built, else PyTorch
    assert plain.attention.name == ("cpu_paged" if built else "torch_sdpa")
    assert type(plain.layer_ops).__name__ == ("CpuFusedLayerOps" if built else "TorchLayerOps")
    hybrid = CpuPlatform().kernels(torch.float32, 16, "float32", linear_attention=True)
    assert isinstance(hybrid.gated_delta_rule, TorchGatedDeltaRule) and asked == [1]
    with torch.device("meta"):
        gdn = GatedDeltaNet(GDN_CONFIG, torch.float32)
    with pytest.raises(AssertionError, match="linear_attention"):
        bind_kernels(gdn, plain)


def test_attention_backends_by_name():
    assert {name: get_attention_backend(name).name for name in ("torch_sdpa", "npu", "flash_attn")} == {
        "torch_sdpa": "torch_sdpa", "npu": "npu", "flash_attn": "flash_attn"}
    with pytest.raises(ValueError, match="available: torch_sdpa, npu, flash_attn, cpu_paged"):
        get_attention_backend("paged")
