"""Quantised linear kernels agree with their plain-PyTorch references
(tengyun/layers/quant_kernels.py): the CPU ones (torch._int_mm, torch's int4 CPU matmul), and the
NPU ones run on a CPU reference of the documented torch_npu ops (fake_torch_npu.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tengyun.layers.quant_kernels import reference_kernel
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.platforms.cpu.kernels.quant import CpuInt4PackKernel, CpuW8A8Kernel
from tengyun.platforms.cpu.kernels.quant_layout import quant_gemv_fits
from tengyun.platforms.npu.platform import NpuPlatform
from tengyun.quantization.compressed_tensors import w8a8_scheme, weight_only_scheme
from tengyun.quantization.packing import pack_int32, quantize_symmetric

sys.path.insert(0, str(Path(__file__).parents[1] / "platforms"))
import fake_torch_npu  # noqa: E402

OUT, IN = 96, 128


def _w8a8_tensors(dtype=torch.float32):
    torch.manual_seed(0)
    q, scale = quantize_symmetric(torch.randn(OUT, IN), 8, None)
    return {"weight": q, "weight_scale": scale.reshape(-1, 1).to(dtype)}


def _wna16_tensors(bits, group, symmetric=True, dtype=torch.float32):
    torch.manual_seed(0)
    q, scale = quantize_symmetric(torch.randn(OUT, IN), bits, group)
    tensors = {"weight_packed": pack_int32(q, bits), "weight_scale": scale.to(dtype)}
    if not symmetric:
        zero = torch.randint(-2, 3, (OUT, scale.shape[1]), dtype=torch.int8)
        tensors["weight_zero_point"] = pack_int32(zero, bits, dim=0)
    return tensors


def _run(kernel, tensors, x, bias=None):
    return kernel.apply(x, kernel.prepare(dict(tensors)), bias)


def test_cpu_w8a8_int_mm_equals_the_reference():
    scheme, tensors = w8a8_scheme(), _w8a8_tensors()
    assert isinstance(CpuPlatform().quant_linear_kernel(scheme, torch.float32), CpuW8A8Kernel)
    x, bias = torch.randn(5, 3, IN), torch.randn(OUT)
    torch.testing.assert_close(_run(CpuW8A8Kernel(scheme), tensors, x, bias),
                               _run(reference_kernel(scheme), tensors, x, bias), rtol=1e-5, atol=1e-5)


def _layouts():
    """CpuInt4PackKernel's two repackings: torch's int4 layout, and the compiled kernel's where it runs."""
    return [False, pytest.param(True, marks=pytest.mark.skipif(not quant_gemv_fits(),
                                                               reason="the compiled quant kernel does not run here"))]


@pytest.mark.parametrize("compiled", _layouts())
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 64])
def test_cpu_int4_matmul_in_bf16_matches_the_reference(group, symmetric, compiled):
    scheme = weight_only_scheme(4, group, symmetric)
    tensors = _wna16_tensors(4, group, symmetric, torch.bfloat16)
    chosen = CpuPlatform().quant_linear_kernel(scheme, torch.bfloat16)
    assert isinstance(chosen, CpuInt4PackKernel) and chosen.compiled == quant_gemv_fits()
    kernel = CpuInt4PackKernel(scheme, compiled=compiled)
    x = torch.randn(7, IN, dtype=torch.bfloat16)
    prepared = kernel.prepare(dict(tensors))
    assert ("qpacked" if compiled else "int4pack") in prepared  # repacked, not the reference's layout
    torch.testing.assert_close(kernel.apply(x, prepared, None).float(),
                               _run(reference_kernel(scheme), tensors, x).float(), rtol=2e-2, atol=5e-2)


def test_cpu_float32_and_unpackable_layers_stay_on_the_exact_reference():
    scheme = weight_only_scheme(4, 32, True)
    assert not isinstance(CpuPlatform().quant_linear_kernel(scheme, torch.float32), CpuInt4PackKernel)
    odd = {k: v[:40] for k, v in _wna16_tensors(4, 32, dtype=torch.bfloat16).items()}  # 40 outputs: not 16k
    kernel = CpuInt4PackKernel(scheme)
    x = torch.randn(2, IN, dtype=torch.bfloat16)
    assert "int4pack" not in kernel.prepare(dict(odd))
    torch.testing.assert_close(_run(kernel, odd, x), _run(reference_kernel(scheme), odd, x))


@pytest.mark.skipif(not quant_gemv_fits(), reason="the compiled quant kernel does not run here")
def test_the_compiled_layout_takes_outputs_torch_cannot_pack():
    scheme = weight_only_scheme(4, 32, False)
    odd = {k: v[:40] if k != "weight_zero_point" else v[:5] for k, v in
           _wna16_tensors(4, 32, False, torch.bfloat16).items()}  # 40 outputs; zero points 8 per int32
    kernel = CpuInt4PackKernel(scheme, compiled=True)
    x, bias = torch.randn(3, IN, dtype=torch.bfloat16), torch.randn(40, dtype=torch.bfloat16)
    prepared = kernel.prepare(dict(odd))
    assert "qpacked" in prepared
    torch.testing.assert_close(kernel.apply(x, prepared, bias).float(),
                               _run(reference_kernel(scheme), odd, x, bias).float(), rtol=2e-2, atol=5e-2)


@pytest.fixture
def fake_npu(monkeypatch):
    fake = fake_torch_npu.module()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])  # the ops take no float32 activations
def test_npu_w8a8_dynamic_quant_and_quant_matmul_equal_the_reference(fake_npu, dtype):
    scheme, tensors = w8a8_scheme(), _w8a8_tensors(dtype)
    kernel = NpuPlatform().quant_linear_kernel(scheme, dtype)
    x, bias = torch.randn(6, IN, dtype=dtype), torch.randn(OUT, dtype=dtype)
    torch.testing.assert_close(_run(kernel, tensors, x, bias), _run(reference_kernel(scheme), tensors, x, bias))
    assert fake_npu.calls["npu_dynamic_quant"] == fake_npu.calls["npu_quant_matmul"] == 1


@pytest.mark.parametrize("bits, group", [(4, 32), (4, None), (8, 64)])
def test_npu_weight_quant_batchmatmul_equals_the_reference(fake_npu, bits, group):
    scheme, tensors = weight_only_scheme(bits, group, True), _wna16_tensors(bits, group, dtype=torch.bfloat16)
    kernel = NpuPlatform().quant_linear_kernel(scheme, torch.bfloat16)
    x = torch.randn(4, IN, dtype=torch.bfloat16)
    # bf16 outputs of magnitude ~10: one ulp is 0.0625, and the two sum in different precisions
    torch.testing.assert_close(_run(kernel, tensors, x).float(), _run(reference_kernel(scheme), tensors, x).float(),
                               rtol=2e-2, atol=0.125)
    assert fake_npu.calls["npu_weight_quant_batchmatmul"] == 1
    assert fake_npu.calls["npu_convert_weight_to_int4pack"] == (1 if bits == 4 else 0)


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 64)])
def test_npu_asymmetric_weights_pass_the_zero_point_as_antiquant_offset(fake_npu, bits, group):
    scheme = weight_only_scheme(bits, group, symmetric=False)
    tensors = _wna16_tensors(bits, group, symmetric=False, dtype=torch.bfloat16)
    kernel = NpuPlatform().quant_linear_kernel(scheme, torch.bfloat16)
    prepared = kernel.prepare(dict(tensors))
    assert prepared["antiquant_offset"].shape == prepared["antiquant_scale"].shape == (IN // group, OUT)
    x = torch.randn(4, IN, dtype=torch.bfloat16)
    torch.testing.assert_close(kernel.apply(x, prepared, None).float(),
                               _run(reference_kernel(scheme), tensors, x).float(), rtol=2e-2, atol=0.125)
    assert fake_npu.calls["npu_weight_quant_batchmatmul"] == 1
