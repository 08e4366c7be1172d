"""W8A8's packed kernel (tengyun/csrc/int8_gemv.cpp, platforms/cpu/kernels/quant.py): bit-equal to the
PyTorch path (per-token quantisation, torch._int_mm, the float32 rescale, then the bias) for 1 to
300 rows (every tile shape, row groups of unequal size, prefill sizes), odd K, output counts that
are not multiples of 16, with and without bias, float32 and bfloat16 activations, every
weight-scale dtype; msModelSlim's static W8A8 alike; the layout; and the fallbacks
(torch._int_mm) when the library is absent or the CPU lacks VNNI."""

from __future__ import annotations

import pytest
import torch

from tengyun.layers.quant_kernels import quantize_per_tensor, quantize_per_token
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.platforms.cpu.kernels.quant import (
    CpuW8A8Kernel, CpuW8A8StaticKernel, pack_w8a8_weight, packed_weight_bytes, w8a8_packed_fits,
)
from tengyun.quantization.compressed_tensors import w8a8_scheme
from tengyun.quantization.modelslim import dynamic_scheme, static_scheme

from test_cpu_paged_attention import kernels  # noqa: F401 - the build-or-skip fixture

SHAPES = [(17, 63), (40, 65), (96, 577), (8, 2)]  # (out, in): K odd or short, out not a multiple of 16
SCALE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# 1-8: one group of every tile height; 9-16: two groups (sizes differ by one at odd counts); 33 and
# 300: many groups and panels (prefill)
ROWS = [*range(1, 17), 33, 300]


@pytest.fixture
def packed(kernels):  # noqa: F811
    if not w8a8_packed_fits():
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
def test_dynamic_kernel_is_bit_equal_to_the_pytorch_path(packed, shape, with_bias, dtype, scale_dtype):
    kernel = CpuW8A8Kernel(w8a8_scheme(), compiled=True)
    assert kernel.packed is not None and kernel.frees_original
    tensors = _dynamic_tensors(*shape, scale_dtype)
    prepared = kernel.prepare(tensors)
    assert "weight" not in prepared  # the packed copy is the only one
    bias = torch.randn(shape[0]).to(dtype) if with_bias else None
    for rows in ROWS:
        x = (torch.randn(rows, shape[1]) * 4).to(dtype)
        x[0, 0] = 0.0 if rows < 3 else x[0, 0]  # an exact zero, and (below) a row of zeros
        if rows == 5:
            x[3] = 0
        got = kernel.apply(x, prepared, bias)
        assert torch.equal(got, _pytorch_dynamic(x, tensors, bias)), (rows, shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_blocks_claimed_in_chunks_by_two_threads_stay_bit_equal(packed, dtype):
    """4,805 outputs (301 blocks, the last partial): on two threads there are blocks for 16 chunks a
    thread, so from 32 rows the threads claim chunks of whole panels (run_all in int8_gemv.cpp), the
    last chunk short; below, they split the blocks once. Every row count gives the PyTorch path's bits."""
    kernel = CpuW8A8Kernel(w8a8_scheme(), compiled=True)
    tensors = _dynamic_tensors(4805, 67, torch.bfloat16, seed=1)
    prepared = kernel.prepare(tensors)
    bias = torch.randn(4805).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (1, 9, 31, 32, 64, 65, 300):
            x = (torch.randn(rows, 67) * 4).to(dtype)
            assert torch.equal(kernel.apply(x, prepared, bias), _pytorch_dynamic(x, tensors, bias)), rows
    finally:
        torch.set_num_threads(threads)


def test_the_layout_holds_blocks_of_16_outputs_by_4_inputs_as_w_plus_128():
    weight = torch.randint(-128, 128, (17, 6), dtype=torch.int8)
    packed = pack_w8a8_weight(weight)
    assert packed.shape == (2, 2, 64) and packed.dtype == torch.uint8
    assert packed.numel() == packed_weight_bytes(17, 6)
    for out, in_ in ((0, 0), (5, 3), (15, 4), (16, 5), (16, 0)):
        block, quad, byte = out // 16, in_ // 4, 4 * (out % 16) + in_ % 4
        assert int(packed[block, quad, byte]) == int(weight[out, in_]) + 128
    assert int(packed[1, 0, 4]) == 128 and int(packed[0, 1, 4 * 3 + 2]) == 128  # zero past N and K


def test_dynamic_kernel_reads_strided_rows_and_keeps_leading_dims(packed):
    kernel = CpuW8A8Kernel(w8a8_scheme(), compiled=True)
    tensors = _dynamic_tensors(33, 70, torch.float32)
    prepared = kernel.prepare(tensors)
    wide = torch.randn(3, 140)
    x = wide[:, :70]  # rows 140 apart
    assert torch.equal(kernel.apply(x, prepared, None), _pytorch_dynamic(x.contiguous(), tensors, None))
    x3 = torch.randn(2, 1, 70)
    assert kernel.apply(x3, prepared, None).shape == (2, 1, 33)


def _static_tensors(out_features, in_features, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {"weight": torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=generator),
            "input_scale": torch.tensor([0.03]), "input_offset": torch.tensor([-7.0]),
            "deq_scale": torch.rand(out_features, generator=generator) * 1e-3,
            "quant_bias": torch.randint(-5000, 5000, (out_features,), dtype=torch.int32, generator=generator)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_static_kernel_is_bit_equal_to_the_pytorch_path(packed, shape, dtype):
    kernel = CpuW8A8StaticKernel(static_scheme(), compiled=True)
    assert kernel.packed is not None
    tensors = _static_tensors(*shape)
    prepared = kernel.prepare(tensors)
    assert "weight" not in prepared
    for rows in ROWS:
        x = (torch.randn(rows, shape[1]) * 3).to(dtype)
        x_q = quantize_per_tensor(x, prepared["input_scale_reciprocal"], prepared["input_offset"])
        acc = torch._int_mm(x_q, tensors["weight"].t()) + prepared["quant_bias"]
        want = (acc.float() * prepared["deq_scale"]).to(dtype)
        assert torch.equal(kernel.apply(x, prepared, None), want), (rows, shape)


def test_static_quantisation_rounds_the_product_before_the_offset(packed):
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


def test_every_row_count_runs_the_one_packed_op(packed):
    kernel = CpuW8A8Kernel(w8a8_scheme(), compiled=True)
    tensors = _dynamic_tensors(40, 65, torch.float32)
    prepared = kernel.prepare(tensors)
    for rows in (1, 64, 65, 2048):
        x = torch.randn(rows, 65)
        ran = _ops_run(lambda: kernel.apply(x, prepared, None))  # noqa: B023 - called at once
        assert "tengyun::w8a8_packed_gemm" in ran and "aten::_int_mm" not in ran, rows


def test_float16_activations_and_scales_run_the_packed_op_through_float32(packed):
    kernel = CpuW8A8Kernel(w8a8_scheme(), compiled=True)
    tensors = _dynamic_tensors(40, 65, torch.float16)
    prepared = kernel.prepare(tensors)
    x, bias = torch.randn(3, 65).half(), torch.randn(40).half()
    got = kernel.apply(x, prepared, bias)
    want = (_pytorch_dynamic(x.float(), tensors, None) + bias.float()).half()
    assert got.dtype == torch.float16 and torch.equal(got, want)


def test_unpacked_kernel_runs_int_mm():
    kernel = CpuW8A8Kernel(w8a8_scheme(), compiled=True, pack=False)
    assert kernel.packed is None and not kernel.frees_original
    tensors = _dynamic_tensors(40, 65, torch.float32)
    assert kernel.prepare(tensors) is tensors
    x = torch.randn(3, 65)
    assert torch.equal(kernel.apply(x, tensors, None), _pytorch_dynamic(x, tensors, None))


def test_platform_picks_the_packed_kernel_for_both_w8a8_kinds_and_plans_its_bytes(packed):
    platform = CpuPlatform()
    assert platform.quant_linear_kernel(w8a8_scheme(), torch.bfloat16).packed is not None
    assert platform.quant_linear_kernel(static_scheme(), torch.bfloat16).packed is not None
    offset = {"weight_offset": torch.zeros(17, 1, dtype=torch.bfloat16)}  # ModelSlim's, dropped
    for scheme, tensors in ((w8a8_scheme(), _dynamic_tensors(17, 63, torch.bfloat16)),
                            (dynamic_scheme(), {**_dynamic_tensors(17, 63, torch.bfloat16), **offset}),
                            (static_scheme(), _static_tensors(17, 63)), (static_scheme("int64"), {
                                **_static_tensors(17, 63), "deq_scale": torch.ones(17, dtype=torch.int64)})):
        held = sum(t.numel() * t.element_size() for t in platform.quant_linear_kernel(scheme, torch.bfloat16)
                   .prepare(tensors).values())
        assert platform.quantized_weight_bytes(scheme, 17, 63, "bfloat16") == held, scheme.description


def test_library_absent_runs_int_mm():
    kernel = CpuW8A8Kernel(w8a8_scheme(), compiled=False)
    static = CpuW8A8StaticKernel(static_scheme(), compiled=False)
    assert kernel.packed is None and static.packed is None
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
        assert not w8a8_packed_fits()
        kernel = CpuW8A8Kernel(w8a8_scheme(), compiled=True)
        assert kernel.packed is None and CpuW8A8StaticKernel(static_scheme(), compiled=True).packed is None
        tensors = _dynamic_tensors(40, 65, torch.float32)
        x = torch.randn(1, 65)
        assert torch.equal(kernel.apply(x, tensors, None), _pytorch_dynamic(x, tensors, None))
        with pytest.raises(RuntimeError, match="lacks AVX-512 VNNI"):
            torch.ops.tengyun.w8a8_packed_gemm(x, pack_w8a8_weight(tensors["weight"]),
                                               tensors["weight_scale"].reshape(-1), None, None, None, None, 40)
    finally:
        torch.ops.tengyun.paged_attention_isa(best)


def test_op_names_a_bad_argument(packed):
    weight, scale = torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)
    layout = pack_w8a8_weight(weight)
    op = torch.ops.tengyun.w8a8_packed_gemm
    with pytest.raises(RuntimeError, match="packed must be a contiguous uint8"):
        op(torch.zeros(1, 12), layout, scale, None, None, None, None, 4)  # K 12: 3 quads, the layout has 2
    with pytest.raises(RuntimeError, match="x must be a CPU float32 or bfloat16"):
        op(torch.zeros(1, 8).half(), layout, scale, None, None, None, None, 4)
    with pytest.raises(RuntimeError, match="together"):
        op(torch.zeros(1, 8), layout, scale, None, None, torch.ones(1), None, 4)
