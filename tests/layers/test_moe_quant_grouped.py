"""Quantised MoE experts as grouped calls (FusedMoE.quant_grouped): on CPU the compiled per-stack
ops (csrc/moe_grouped.cpp), on NPU torch_npu's quantised npu_grouped_matmul (checked on the
documented stand-in, tests/platforms/fake_torch_npu_moe.py). Each equals the per-expert loop it
replaces, through the same kernel, and reads nothing back to the host."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tengyun.layers.fused_moe import FusedMoE
from tengyun.layers.kernels import KernelBundle
from tengyun.layers.moe.grouped import loop_experts
from tengyun.platforms.cpu.kernels.quant_layout import quant_gemv_fits
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.quantization.compressed_tensors import w8a8_scheme, weight_only_scheme
from tengyun.quantization.modelslim import static_scheme
from tengyun.quantization.packing import pack_int32, quantize_symmetric

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "platforms"))
from test_moe_grouped import HostReads  # noqa: E402

import fake_torch_npu  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 64, 32
PROJECTIONS = {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}
compiled = pytest.mark.skipif(not quant_gemv_fits(), reason="the compiled CPU kernels do not run here")


def _checkpoint_tensors(scheme, out: int, in_: int, dtype) -> dict[str, torch.Tensor]:
    """One expert projection's tensors as a compressed-tensors checkpoint holds them."""
    q, scale = quantize_symmetric(torch.randn(out, in_) * 0.2, scheme.weight_bits, scheme.group_size)
    if scheme.kernel == "w8a8_int8":
        return {"weight": q, "weight_scale": scale.reshape(-1, 1).to(dtype)}
    if scheme.kernel == "w8a8_static_int8":  # msModelSlim W8A8: one input scale and offset per layer
        input_scale = 0.02 + 0.02 * torch.rand(1)  # each expert its own (gate and up share one)
        return {"weight": q, "weight_scale": scale.reshape(-1, 1).to(dtype),
                "weight_offset": torch.zeros(out, 1, dtype=dtype), "input_scale": input_scale.to(dtype),
                "input_offset": torch.randint(-4, 5, (1,)).to(dtype),
                "deq_scale": (scale.flatten() * input_scale).float(),
                "quant_bias": torch.randint(-50, 50, (out,), dtype=torch.int32)}
    tensors = {"weight_packed": pack_int32(q, scheme.weight_bits), "weight_scale": scale.to(dtype),
               "weight_shape": torch.tensor([out, in_])}
    if not scheme.symmetric:
        zero = torch.randint(-2, 3, (out, scale.shape[1]), dtype=torch.int8)
        tensors["weight_zero_point"] = pack_int32(zero, scheme.weight_bits, dim=0)
    return tensors


def quantised_layer(scheme, dtype, kernel, seed=0) -> FusedMoE:
    """A tiny FusedMoE whose experts hold ``scheme``'s random tensors, loaded through its weight
    loader and bound to ``kernel`` (the layer's dense MoE kernel stays PyTorch's)."""
    torch.manual_seed(seed)
    layer = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, True, dtype)
    layer.use_quant_scheme(scheme, "mlp.experts")
    for expert in range(EXPERTS):
        for proj, (out, in_) in PROJECTIONS.items():
            for leaf, tensor in _checkpoint_tensors(scheme, out, in_, dtype).items():
                name, shard_id = FusedMoE.checkpoint_name_to_param(f"mlp.experts.{expert}.{proj}.{leaf}")
                param = getattr(layer, name.rpartition(".")[2])
                param.weight_loader(param, tensor, shard_id)
    layer.bind_kernels(KernelBundle(attention=None, linear=None, layer_ops=None, gated_delta_rule=None,
                                    quant_linear={scheme: kernel}))
    return layer


def _inputs(dtype, tokens, seed=1):
    torch.manual_seed(seed)
    return torch.randn(tokens, HIDDEN, dtype=dtype), torch.randn(tokens, EXPERTS, dtype=dtype)


def _loop(layer: FusedMoE, x, logits):
    """The per-expert loop the grouped path replaced, through the same kernel and weights."""
    weights, ids = layer.moe_kernel.route(logits, layer.top_k, layer.renormalize)
    return loop_experts(x, weights, ids, layer.first_expert, layer.num_local, layer._expert)


CPU_CASES = [  # (scheme, activation dtype): the CPU kernel each takes runs its experts grouped
    pytest.param(w8a8_scheme(), torch.float32, id="w8a8-fp32"),
    pytest.param(w8a8_scheme(), torch.bfloat16, id="w8a8-bf16"),
    pytest.param(w8a8_scheme(), torch.float16, id="w8a8-fp16"),
    pytest.param(weight_only_scheme(4, 32, True), torch.bfloat16, id="w4a16-g32"),
    pytest.param(weight_only_scheme(4, 32, False), torch.bfloat16, id="w4a16-g32-asym"),
    pytest.param(weight_only_scheme(8, None, True), torch.bfloat16, id="w8a16-channel"),
    pytest.param(static_scheme(), torch.bfloat16, id="modelslim-static-w8a8-bf16"),
    pytest.param(static_scheme(), torch.float32, id="modelslim-static-w8a8-fp32"),
]


@compiled
@pytest.mark.parametrize("scheme, dtype", CPU_CASES)
@pytest.mark.parametrize("tokens", [1, 7, 200])  # 200: ~50 rows per expert, past the kernel's rows (dequantized)
def test_cpu_quantised_experts_run_grouped_and_equal_the_loop(scheme, dtype, tokens):
    layer = quantised_layer(scheme, dtype, CpuPlatform().quant_linear_kernel(scheme, dtype))
    assert layer.quant_grouped and layer.supports_graph_capture
    x, logits = _inputs(dtype, tokens)
    torch.testing.assert_close(layer(x, logits), _loop(layer, x, logits), rtol=0, atol=0)


@compiled
@pytest.mark.parametrize("scheme, dtype", CPU_CASES[:2] + CPU_CASES[3:4])
def test_quantised_moe_forward_reads_nothing_back_to_the_host(scheme, dtype):
    layer = quantised_layer(scheme, dtype, CpuPlatform().quant_linear_kernel(scheme, dtype))
    x, logits = _inputs(dtype, 16)
    with HostReads() as reads:
        layer(x, logits)
    assert reads.calls == []


def test_quantised_experts_without_a_grouped_kernel_keep_the_loop_and_say_so():
    """4-bit weight-only in float32 runs the reference kernel: no grouped form, the counts are read."""
    scheme = weight_only_scheme(4, 32, True)
    layer = quantised_layer(scheme, torch.float32, CpuPlatform().quant_linear_kernel(scheme, torch.float32))
    assert not layer.quant_grouped and not layer.supports_graph_capture
    x, logits = _inputs(torch.float32, 9)
    with HostReads() as reads:
        got = layer(x, logits)
    assert "tolist" in reads.calls
    torch.testing.assert_close(got, _loop(layer, x, logits), rtol=0, atol=0)


def test_a_rank_holding_some_experts_sums_only_theirs():
    """Expert parallel: experts [4, 8) of 8 here; the other experts' rows come out of the grouped
    call as zeros and add nothing."""
    scheme = w8a8_scheme()
    layer = quantised_layer(scheme, torch.float32, CpuPlatform().quant_linear_kernel(scheme, torch.float32))
    if not layer.quant_grouped:  # AVX2 cores: no W8A8 kernel groups experts (per-expert lists instead)
        pytest.skip("the W8A8 kernel does not group experts on this CPU")
    x, logits = _inputs(torch.float32, 11)
    weights, ids = layer.moe_kernel.route(logits, TOP_K, True)
    full = layer._local_experts(x, weights, ids)
    layer.first_expert, layer.num_local = 4, 4
    layer.kernel_weight = {k: {n: t[4:] for n, t in v.items()} for k, v in layer.kernel_weight.items()}
    half = layer._local_experts(x, weights, ids)
    torch.testing.assert_close(half, _loop(layer, x, logits), rtol=0, atol=0)
    assert not torch.equal(half, full)


@pytest.fixture
def fake_npu(monkeypatch):
    fake = fake_torch_npu.module()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


@pytest.mark.parametrize("scheme", [pytest.param(w8a8_scheme(), id="w8a8"),
                                    pytest.param(weight_only_scheme(8, None, False), id="w8a16-channel-asym")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_npu_quantised_experts_run_one_grouped_matmul_per_stack(fake_npu, scheme, dtype):
    from tengyun.platforms.npu.kernels.quant import npu_quant_kernel

    layer = quantised_layer(scheme, dtype, npu_quant_kernel(scheme))
    assert layer.quant_grouped and layer.supports_graph_capture
    x, logits = _inputs(dtype, 13)
    got = layer(x, logits)  # (the stand-in's own checks read the host: no HostReads here)
    per_expert_ops = fake_npu.calls["npu_quant_matmul"] + fake_npu.calls["npu_weight_quant_batchmatmul"]
    assert fake_npu.calls["npu_grouped_matmul"] == 2 and per_expert_ops == 0
    # the loop runs each expert through npu_quant_matmul / npu_weight_quant_batchmatmul; the grouped
    # W8A8 call takes its weight scale in bfloat16 for bfloat16 outputs (the op's data-type table)
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got, _loop(layer, x, logits), **tolerance)


def test_npu_4bit_experts_keep_the_loop(fake_npu):
    """No documented 3-D int4 pack for npu_grouped_matmul: 4-bit weight-only experts loop."""
    from tengyun.platforms.npu.kernels.quant import npu_quant_kernel

    scheme = weight_only_scheme(4, 32, True)
    layer = quantised_layer(scheme, torch.bfloat16, npu_quant_kernel(scheme))
    assert not layer.quant_grouped and not layer.supports_graph_capture
