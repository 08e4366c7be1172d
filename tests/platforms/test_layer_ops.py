"""Layer ops (tengyun/layers/layer_ops.py): the PyTorch default reproduces HF's norm and rotary
arithmetic bit for bit, and the NPU ops (tengyun/platforms/npu/kernels/layer_ops.py) agree with it when run on
a CPU reference of the documented torch_npu ops (fake_torch_npu.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tengyun.platforms.cpu import native as cpu_kernels
from tengyun.layers.attention.torch_sdpa import TorchSDPABackend
from tengyun.layers.kernels import KernelBundle
from tengyun.layers.layer_ops import TORCH_LAYER_OPS, TorchLayerOps
from tengyun.layers.layernorm import GatedRMSNorm, RMSNorm, ZeroCenteredRMSNorm
from tengyun.layers.linear_kernel import DenseLinearKernel
from tengyun.layers.rotary_embedding import RotaryEmbedding
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.platforms.cpu.kernels.layer_ops import CpuFusedLayerOps
from tengyun.platforms.cuda.platform import CudaPlatform
from tengyun.platforms.npu.platform import NpuPlatform

sys.path.insert(0, str(Path(__file__).parent))
import fake_torch_npu  # noqa: E402

ROPE = dict(rope_type="default", rope_theta=10000.0)


@pytest.fixture
def fake_npu(monkeypatch):
    fake = fake_torch_npu.module()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


def _kernels(layer_ops: TorchLayerOps) -> KernelBundle:
    """What the worker binds, with these norm/rotary ops."""
    return KernelBundle(attention=TorchSDPABackend(), linear=DenseLinearKernel(), layer_ops=layer_ops,
                        gated_delta_rule=None)


def _norm(cls, hidden, dtype, seed=0):
    torch.manual_seed(seed)
    norm = cls(hidden, 1e-6, dtype)
    norm.weight.data.normal_(0.0, 0.3 if cls is ZeroCenteredRMSNorm else 1.0)
    return norm


def test_cuda_uses_the_pytorch_ops_and_cpu_its_compiled_ones_once_built():
    assert CudaPlatform().layer_ops() is TORCH_LAYER_OPS
    cpu = CpuPlatform().layer_ops()
    if cpu_kernels.load_error() is None:
        assert isinstance(cpu, CpuFusedLayerOps)  # tests/layers/test_cpu_layer_ops.py checks their arithmetic
    else:
        assert cpu is TORCH_LAYER_OPS


@pytest.mark.parametrize("bind", [False, True])
def test_default_ops_reproduce_hf_rounding_in_bf16(bind):
    x, residual = torch.randn(5, 64).bfloat16() * 3, torch.randn(5, 64).bfloat16()
    plain, zero = _norm(RMSNorm, 64, torch.bfloat16), _norm(ZeroCenteredRMSNorm, 64, torch.bfloat16)
    if bind:
        plain.bind_kernels(_kernels(TORCH_LAYER_OPS))
        zero.bind_kernels(_kernels(TORCH_LAYER_OPS))

    def normed(h):
        h32 = h.float()
        return h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)

    # HF Llama: round the norm to bf16, then times the bf16 weight; HF Qwen3.5: times 1 + w in float32.
    assert torch.equal(plain(x), plain.weight * normed(x).bfloat16())
    assert torch.equal(zero(x), (normed(x) * (1.0 + zero.weight.float())).bfloat16())
    y, summed = plain(x, residual)
    assert torch.equal(summed, x + residual) and torch.equal(y, plain.weight * normed(x + residual).bfloat16())
    y, _ = zero(x, residual)
    assert torch.equal(y, (normed(x + residual) * (1.0 + zero.weight.float())).bfloat16())


@pytest.mark.parametrize("rotary_dim", [16, 4])
def test_default_rotary_is_the_neox_rotation_of_the_first_rotary_dim_channels(rotary_dim):
    rope = RotaryEmbedding(16, rotary_dim, 64, ROPE)
    positions = torch.tensor([0, 3, 63])
    q, k = torch.randn(3, 4 * 16).bfloat16(), torch.randn(3, 2 * 16).bfloat16()
    q_out, k_out = rope(positions, q, k)
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    for x, out in ((q, q_out), (k, k_out)):
        x, out = x.view(3, -1, 16), out.view(3, -1, 16)
        x1, x2 = x[..., :rotary_dim].float().chunk(2, dim=-1)
        expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).bfloat16()
        assert torch.equal(out[..., :rotary_dim], expected)
        assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


def test_npu_platform_supplies_the_npu_ops(fake_npu):
    from tengyun.platforms.npu.kernels.layer_ops import NpuLayerOps

    assert isinstance(NpuPlatform().layer_ops(), NpuLayerOps)


@pytest.mark.parametrize("cls", [RMSNorm, ZeroCenteredRMSNorm])
def test_npu_norms_call_the_fused_ops_and_match_pytorch(fake_npu, cls):
    from tengyun.platforms.npu.kernels.layer_ops import NpuLayerOps

    x, residual = torch.randn(7, 3, 32), torch.randn(7, 3, 32)
    reference, npu = _norm(cls, 32, torch.float32), _norm(cls, 32, torch.float32)
    npu.bind_kernels(_kernels(NpuLayerOps()))
    torch.testing.assert_close(npu(x), reference(x))
    assert fake_npu.calls == {"npu_rms_norm": 1}
    y, summed = npu(x, residual)
    y_ref, summed_ref = reference(x, residual)
    torch.testing.assert_close(y, y_ref)
    assert torch.equal(summed, summed_ref)
    assert fake_npu.calls == {"npu_rms_norm": 1, "npu_add_rms_norm": 1}


def test_npu_norm_takes_one_plus_w_in_the_model_dtype(fake_npu):
    from tengyun.platforms.npu.kernels.layer_ops import NpuLayerOps

    norm = _norm(ZeroCenteredRMSNorm, 32, torch.bfloat16)
    norm.bind_kernels(_kernels(NpuLayerOps()))  # npu_rms_norm asserts gamma has x's dtype
    assert norm.gamma.dtype == torch.bfloat16
    assert torch.equal(norm.gamma, (1.0 + norm.weight.float()).bfloat16())
    x = torch.randn(4, 32).bfloat16()
    assert norm(x).dtype == torch.bfloat16
    torch.testing.assert_close(norm(x), _norm(ZeroCenteredRMSNorm, 32, torch.bfloat16)(x), atol=2e-2, rtol=2e-2)


def test_npu_gated_norm_fuses_the_norm_and_keeps_the_gate_in_pytorch(fake_npu):
    from tengyun.platforms.npu.kernels.layer_ops import NpuLayerOps

    x, gate = torch.randn(5, 4, 8), torch.randn(5, 4, 8)
    reference, npu = _norm(GatedRMSNorm, 8, torch.float32), _norm(GatedRMSNorm, 8, torch.float32)
    npu.bind_kernels(_kernels(NpuLayerOps()))
    torch.testing.assert_close(npu(x, gate), reference(x, gate))
    assert fake_npu.calls == {"npu_rms_norm": 1}


@pytest.mark.parametrize("head_dim,rotary_dim", [(32, 32), (16, 4)])  # full; partial as Qwen3.5
def test_npu_rotary_rotates_only_the_rotary_channels(fake_npu, head_dim, rotary_dim):
    from tengyun.platforms.npu.kernels.layer_ops import NpuLayerOps

    reference, npu = RotaryEmbedding(head_dim, rotary_dim, 128, ROPE), RotaryEmbedding(head_dim, rotary_dim, 128, ROPE)
    npu.bind_kernels(_kernels(NpuLayerOps()))
    positions = torch.tensor([0, 1, 5, 127, 64])
    q, k = torch.randn(5, 4 * head_dim), torch.randn(5, 2 * head_dim)
    q_npu, k_npu = npu(positions, q, k)
    q_ref, k_ref = reference(positions, q, k)
    torch.testing.assert_close(q_npu, q_ref)
    torch.testing.assert_close(k_npu, k_ref)
    assert torch.equal(q_npu.view(5, 4, head_dim)[..., rotary_dim:], q.view(5, 4, head_dim)[..., rotary_dim:])
    assert fake_npu.calls == {"npu_rotary_mul": 2}


def test_npu_rotary_leaves_yarn_on_pytorch(fake_npu):
    from tengyun.platforms.npu.kernels.layer_ops import NpuLayerOps

    yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)
    rope = RotaryEmbedding(16, 16, 128, yarn)
    assert rope.scale > 1  # cos, sin past 1: outside npu_rotary_mul's documented [-1, 1]
    rope.bind_kernels(_kernels(NpuLayerOps()))
    assert rope.ops is TORCH_LAYER_OPS
    rope(torch.tensor([100]), torch.randn(1, 16), torch.randn(1, 16))
    assert fake_npu.calls == {}
