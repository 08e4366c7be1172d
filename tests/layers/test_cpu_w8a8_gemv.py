"""W8A8's small-batch kernel (tengyun/csrc/int8_gemv.cpp, platforms/cpu_quant.py): bit-equal to
the PyTorch path (per-token quantisation, torch._int_mm, the float32 rescale, then the bias) for
1-8 rows, odd K, output counts that are not multiples of 16, with and without bias, float32 and
bfloat16 activations, every weight-scale dtype; msModelSlim's static W8A8 alike; the routing by
row count; and the fallbacks (torch._int_mm) when the library is absent or the CPU lacks VNNI."""

from __future__ import annotations

import pytest
import torch

from tengyun.layers.quant_kernels import quantize_per_tensor, quantize_per_token
from tengyun.platforms.cpu import CpuPlatform
from tengyun.platforms.cpu_quant import MAX_GEMV_ROWS, CpuW8A8Kernel, CpuW8A8StaticKernel, w8a8_gemv_fits
from tengyun.quantization.compressed_tensors import w8a8_scheme
from tengyun.quantization.modelslim import static_scheme

from test_cpu_paged_attention import kernels  # noqa: F401 - the build-or-skip fixture

SHAPES = [(17, 63), (40, 65), (96, 577), (8, 2)]  # (out, in): K odd or short, out not a multiple of 16
SCALE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def gemv(kernels):  # noqa: F811
    if not w8a8_gemv_fits():
        pytest.skip("this CPU lacks AVX-512 VNNI: W8A8 runs torch._int_mm only")
    return kernels


def _dynamic_tensors(out_features, in_features, scale_dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
    scale = (torch.rand(out_features, 1, generator=generator) * 0.02 + 1e-4).to(scale_dtype)
    return {"weight": weight, "weight_scale": scale}


def _pytorch_dynamic(x, tensors, bias):
    """The PyTorch path: quantize_per_token, torch._int_mm, the float32 rescale, then the bias."""
    x_q, s_x = quantize_per_token(x)
    acc = torch._int_mm(x_q, tensors["weight"].t())
    y = (acc.float() * s_x * tensors["weight_scale"].float().t()).to(x.dtype)
    return y if bias is None else y + bias


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_dynamic_kernel_is_bit_equal_to_the_pytorch_path(gemv, shape, with_bias, dtype, scale_dtype):
    kernel = CpuW8A8Kernel(w8a8_scheme(), compiled=True)
    assert kernel.gemv is not None
    tensors = _dynamic_tensors(*shape, scale_dtype)
    bias = torch.randn(shape[0]).to(dtype) if with_bias else None
    for rows in range(1, MAX_GEMV_ROWS + 1):
        x = (torch.randn(rows, shape[1]) * 4).to(dtype)
        x[0, 0] = 0.0 if rows < 3 else x[0, 0]  # an exact zero, and (below) a row of zeros
        if rows == 5:
            x[3] = 0
        got = kernel.apply(x, kernel.prepare(tensors), bias)
        assert torch.equal(got, _pytorch_dynamic(x, tensors, bias)), (rows, shape)


def test_dynamic_kernel_reads_strided_rows_and_keeps_leading_dims(gemv):
    kernel = CpuW8A8Kernel(w8a8_scheme(), compiled=True)
    tensors = _dynamic_tensors(33, 70, torch.float32)
    wide = torch.randn(3, 140)
    x = wide[:, :70]  # rows 140 apart
    assert torch.equal(kernel.apply(x, tensors, None), _pytorch_dynamic(x.contiguous(), tensors, None))
    x3 = torch.randn(2, 1, 70)
    assert kernel.apply(x3, tensors, None).shape == (2, 1, 33)


def _static_tensors(out_features, in_features, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {"weight": torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=generator),
            "input_scale": torch.tensor([0.03]), "input_offset": torch.tensor([-7.0]),
            "deq_scale": torch.rand(out_features, generator=generator) * 1e-3,
            "quant_bias": torch.randint(-5000, 5000, (out_features,), dtype=torch.int32, generator=generator)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_static_kernel_is_bit_equal_to_the_pytorch_path(gemv, shape, dtype):
    kernel = CpuW8A8StaticKernel(static_scheme(), compiled=True)
    assert kernel.gemv is not None
    prepared = kernel.prepare(_static_tensors(*shape))
    for rows in range(1, MAX_GEMV_ROWS + 1):
        x = (torch.randn(rows, shape[1]) * 3).to(dtype)
        x_q = quantize_per_tensor(x, prepared["input_scale_reciprocal"], prepared["input_offset"])
        acc = torch._int_mm(x_q, prepared["weight"].t()) + prepared["quant_bias"]
        want = (acc.float() * prepared["deq_scale"]).to(dtype)
        assert torch.equal(kernel.apply(x, prepared, None), want), (rows, shape)


def test_static_quantisation_rounds_the_product_before_the_offset(gemv):
    """x = -0.33 (float32 -0.32999998) * 50 rounds to -16.5, + 3 is -13.5 -> -14 (half to even);
    an fma would give -13.4999991 -> -13."""
    kernel = CpuW8A8StaticKernel(static_scheme(), compiled=True)
    tensors = {**_static_tensors(16, 16), "input_scale": torch.tensor([0.02]), "input_offset": torch.tensor([3.0]),
               "weight": torch.eye(16, dtype=torch.int8), "deq_scale": torch.ones(16),
               "quant_bias": torch.zeros(16, dtype=torch.int32)}
    prepared = kernel.prepare(tensors)
    x = torch.full((1, 16), -0.33)
    product = x * prepared["input_scale_reciprocal"]
    assert float(x[0, 0]) * 50 != -16.5 and torch.equal(product, torch.full((1, 16), -16.5))
    assert torch.equal(kernel.apply(x, prepared, None), torch.full((1, 16), -14.0))


def _ops_run(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fn()
    return {event.name for event in profile.events()}


def test_rows_past_the_limit_run_int_mm_with_the_same_weight(gemv):
    kernel = CpuW8A8Kernel(w8a8_scheme(), compiled=True)
    tensors = _dynamic_tensors(40, 65, torch.float32)
    prepared = kernel.prepare(tensors)
    assert prepared["weight"] is tensors["weight"]  # one int8 copy serves both paths
    few, many = torch.randn(MAX_GEMV_ROWS, 65), torch.randn(MAX_GEMV_ROWS + 1, 65)
    assert "tengyun::w8a8_gemv" in _ops_run(lambda: kernel.apply(few, prepared, None))
    ran = _ops_run(lambda: kernel.apply(many, prepared, None))
    assert "aten::_int_mm" in ran and "tengyun::w8a8_gemv" not in ran
    assert torch.equal(kernel.apply(many, prepared, None), _pytorch_dynamic(many, tensors, None))
    assert CpuW8A8Kernel(w8a8_scheme(), compiled=True, max_gemv_rows=0).gemv is None
    wide = CpuW8A8Kernel(w8a8_scheme(), compiled=True, max_gemv_rows=1000)  # the op takes 64 rows at most
    x65 = torch.randn(65, 65)
    assert torch.equal(wide.apply(x65, prepared, None), _pytorch_dynamic(x65, tensors, None))


def test_float16_activations_and_strided_weights_take_int_mm(gemv):
    kernel = CpuW8A8Kernel(w8a8_scheme(), compiled=True)
    tensors = _dynamic_tensors(40, 65, torch.float16)
    x = torch.randn(2, 65).half()
    assert "tengyun::w8a8_gemv" not in _ops_run(lambda: kernel.apply(x, tensors, None))
    wide = _dynamic_tensors(40, 130, torch.float32)
    sliced = {**wide, "weight": wide["weight"][:, :65]}  # a row-parallel slice, not copied
    x = torch.randn(2, 65)
    assert "tengyun::w8a8_gemv" not in _ops_run(lambda: kernel.apply(x, sliced, None))
    assert torch.equal(kernel.apply(x, sliced, None), _pytorch_dynamic(x, sliced, None))


def test_platform_picks_the_kernel_for_both_w8a8_kinds(gemv):
    platform = CpuPlatform()
    assert platform.quant_linear_kernel(w8a8_scheme(), torch.bfloat16).gemv is not None
    assert platform.quant_linear_kernel(static_scheme(), torch.bfloat16).gemv is not None


def test_library_absent_runs_int_mm():
    kernel = CpuW8A8Kernel(w8a8_scheme(), compiled=False)
    static = CpuW8A8StaticKernel(static_scheme(), compiled=False)
    assert kernel.gemv is None and static.gemv is None
    tensors = _dynamic_tensors(40, 65, torch.float32)
    x = torch.randn(1, 65)
    assert torch.equal(kernel.apply(x, tensors, None), _pytorch_dynamic(x, tensors, None))


def test_cpu_without_avx512_vnni_runs_int_mm_and_the_op_refuses(kernels):  # noqa: F811
    best = kernels.isa()
    try:
        torch.ops.tengyun.paged_attention_isa("avx2")  # the AVX-512 copies off, as on a CPU without them
    except RuntimeError:
        pytest.skip("this CPU lacks AVX2")
    try:
        assert not w8a8_gemv_fits()
        kernel = CpuW8A8Kernel(w8a8_scheme(), compiled=True)
        assert kernel.gemv is None and CpuW8A8StaticKernel(static_scheme(), compiled=True).gemv is None
        tensors = _dynamic_tensors(40, 65, torch.float32)
        x = torch.randn(1, 65)
        assert torch.equal(kernel.apply(x, tensors, None), _pytorch_dynamic(x, tensors, None))
        with pytest.raises(RuntimeError, match="lacks AVX-512 VNNI"):
            torch.ops.tengyun.w8a8_gemv(x, tensors["weight"], tensors["weight_scale"], None, None, None, None)
    finally:
        torch.ops.tengyun.paged_attention_isa(best)


def test_op_names_a_bad_argument(gemv):
    weight, scale = torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)
    with pytest.raises(RuntimeError, match="M <= 64"):
        torch.ops.tengyun.w8a8_gemv(torch.zeros(65, 8), weight, scale, None, None, None, None)
    with pytest.raises(RuntimeError, match="weight must be a contiguous int8"):
        torch.ops.tengyun.w8a8_gemv(torch.zeros(1, 8), weight.t().contiguous().t(), scale, None, None, None, None)
    with pytest.raises(RuntimeError, match="together"):
        torch.ops.tengyun.w8a8_gemv(torch.zeros(1, 8), weight, scale, None, None, torch.ones(1), None)
