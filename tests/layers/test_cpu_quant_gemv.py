"""The compiled weight-only quantised linear (tengyun/csrc/quant_gemv.cpp, platforms/cpu/kernels/quant_layout.py)
against its arithmetic contract: the layout's dequantized weights are the reference's float32
(n - zero) * s exactly, and products match float64 x @ w^T up to float32 sums and one bfloat16
rounding, and torch's int4 matmul (the path it replaces) within bfloat16 tolerance: odd group
counts, outputs not a multiple of 16 or 32, 1-8 rows, bias or none, groups 32/64/128, zero points
or symmetric, bfloat16 or float16 scales, strided rows; the 8-bit path; the dense path for many
rows; and the fallbacks when the library is absent."""

from __future__ import annotations

import pytest
import torch

from tengyun.platforms.cpu import native as cpu_kernels
from tengyun.platforms.cpu.kernels import quant_layout as layout
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.platforms.cpu.kernels.gguf import CpuGgufInt4PackKernel
from tengyun.quantization.compressed_tensors import weight_only_scheme
from tengyun.quantization.gguf import scheme_for_type

from test_cpu_paged_attention import kernels  # noqa: F401 - the build-or-skip fixture

# one bfloat16 rounding of the result (2^-8 relative) over float32 sums of a few hundred terms
KERNEL_TOLERANCE = dict(rtol=2 ** -7, atol=1e-2)


@pytest.fixture
def fits(kernels):  # noqa: F811
    if not layout.quant_gemv_fits():
        pytest.skip("this CPU lacks AVX-512 BF16: the compiled quant kernel does not run")


def _layer(out, in_, group, symmetric, scale_dtype=torch.bfloat16, seed=0):
    """n uint8 [out, in] in [0, 16), scale [out, groups], zero points uint8 or None, and the
    reference's float32 w = (n - zero) * s (zero 8 when symmetric)."""
    generator = torch.Generator().manual_seed(seed)
    groups = in_ // group
    n = torch.randint(0, 16, (out, in_), dtype=torch.uint8, generator=generator)
    scale = (torch.rand(out, groups, generator=generator) * 0.02 + 1e-3).to(scale_dtype)
    zero = None if symmetric else torch.randint(0, 16, (out, groups), dtype=torch.uint8, generator=generator)
    points = torch.full((out, groups), 8.0) if zero is None else zero.float()
    w = (n.float().view(out, groups, group) - points[..., None]) * scale.float()[..., None]
    return n, scale, zero, w.reshape(out, in_)


@pytest.mark.parametrize("out, in_, group", [(40, 96, 32), (100, 192, 64), (33, 384, 128), (64, 160, 32)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_dequantized_weights_are_the_references_exactly(fits, out, in_, group, symmetric):
    for scale_dtype in (torch.bfloat16, torch.float16):
        n, scale, zero, w = _layer(out, in_, group, symmetric, scale_dtype)
        prepared = layout.pack(n, 4, scale, zero)
        assert torch.equal(layout.dequantized_t(prepared, 4, 8).t(), w)
        assert torch.equal(layout.dequantized_t(prepared, 4, 8, "bfloat16").t(), w.bfloat16())


@pytest.mark.parametrize("out, in_, group", [(40, 96, 32), (100, 192, 64), (33, 384, 128), (576, 160, 32)])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_kernel_matches_float64_on_the_same_weights(fits, out, in_, group, symmetric, with_bias):
    n, scale, zero, w = _layer(out, in_, group, symmetric, torch.float16 if symmetric else torch.bfloat16)
    prepared = layout.pack(n, 4, scale, zero)
    bias = torch.randn(out).bfloat16() if with_bias else None
    for rows in range(1, 9):
        x = torch.randn(rows, in_).bfloat16()
        want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
        got = layout.linear(x, prepared, 4, 8, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
        torch.testing.assert_close(got.double(), want, **KERNEL_TOLERANCE)


def test_kernel_matches_torchs_int4_matmul_which_it_replaces(fits):
    """torch's w = (n - 8) * s + z with z = -(zero - 8) * s rounded to bfloat16: the same layer
    within bfloat16 tolerance (the zero terms' rounding differs, not the kernel's)."""
    n, scale, zero, _ = _layer(96, 256, 64, symmetric=False)
    prepared = layout.pack(n, 4, scale, zero)
    int4pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(n.to(torch.int32), 1)
    zero_term = (-(zero.float() - 8) * scale.float()).bfloat16()
    scales_and_zeros = torch.stack([scale.t(), zero_term.t()], dim=-1).contiguous()
    for rows in (1, 4, 7):
        x = torch.randn(rows, 256).bfloat16()
        torch_y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4pack, 64, scales_and_zeros)
        torch.testing.assert_close(layout.linear(x, prepared, 4, 8, None).float(), torch_y.float(),
                                   rtol=2e-2, atol=5e-2)


def test_strided_rows_gathered_inputs_and_many_rows(fits):
    """Rows of a wider tensor (act order's gathered activations are such a copy), and past
    MAX_KERNEL_ROWS the weight dequantized once and multiplied densely (bfloat16 w: the
    reference's rounding)."""
    n, scale, zero, w = _layer(64, 128, 32, symmetric=False)
    prepared = layout.pack(n, 4, scale, zero)
    wide = torch.randn(3, 200).bfloat16()
    x = wide[:, 8:136]
    perm = torch.randperm(128)
    for rows in (x, wide[:, :128].index_select(1, perm)):
        torch.testing.assert_close(layout.linear(rows, prepared, 4, 8, None).double(),
                                   rows.double() @ w.double().t(), **KERNEL_TOLERANCE)
    many = torch.randn(layout.MAX_KERNEL_ROWS + 5, 128).bfloat16()
    torch.testing.assert_close(layout.linear(many, prepared, 4, 8, None).float(),
                               many.float() @ w.bfloat16().float().t(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("flags,rows", [(frozenset({"avx512_bf16"}), 32), (frozenset({"avx512_bf16", "amx_bf16"}), 16)])
def test_the_kernel_row_limit_follows_amx(fits, monkeypatch, flags, rows):
    """On cores with AMX the dense path (dequantize, then AMX's bfloat16 matmul) wins from ~20 rows:
    17 rows run the kernel elsewhere, the dense path there."""
    import tengyun.host.probe as probe

    monkeypatch.setattr(probe, "cpu_flags", lambda: flags)
    layout.kernel_rows.cache_clear()
    try:
        assert layout.kernel_rows() == rows
        n, scale, zero, _ = _layer(64, 128, 32, symmetric=False)
        prepared = layout.pack(n, 4, scale, zero)
        calls = []
        monkeypatch.setattr(layout, "dequantized_t", lambda *args: calls.append(args) or torch.zeros(128, 64))
        layout.linear(torch.randn(17, 128).bfloat16(), prepared, 4, 8, None)
        assert bool(calls) == (rows < 17)
    finally:
        layout.kernel_rows.cache_clear()


@pytest.mark.parametrize("bits", [4, 8])
def test_a_large_weight_runs_the_kernel_on_row_chunks(fits, monkeypatch, bits):
    """A weight whose dequantized copy is LARGE_WEIGHT_BYTES or more (an LM head) past kernel_rows()
    rows: the kernel on chunks of kernel_rows() rows (bit-equal to calling it per chunk), never the
    dequantized copy, up to LARGE_WEIGHT_CHUNKED_ROWS rows; a smaller weight and more rows: the copy."""
    monkeypatch.setattr(layout, "kernel_rows", lambda: 8)
    n, scale, zero, w = _layer(96, 128, 32, symmetric=True)
    prepared = layout.pack(n if bits == 4 else (n.to(torch.int8) - 8), bits, scale)
    zero_point = 8 if bits == 4 else 0
    bias = torch.randn(96).bfloat16()
    x = torch.randn(21, 128).bfloat16()
    monkeypatch.setattr(layout, "LARGE_WEIGHT_BYTES", 2 * 128 * 96)  # this layer counts as large
    chunks = torch.cat([layout.linear(c, prepared, bits, zero_point, bias) for c in x.split(8)])
    copies = []
    real_dequantized_t = layout.dequantized_t
    monkeypatch.setattr(layout, "dequantized_t", lambda *a: copies.append(a) or real_dequantized_t(*a))
    assert torch.equal(layout.linear(x, prepared, bits, zero_point, bias), chunks) and not copies
    torch.testing.assert_close(chunks.double(), x.double() @ w.double().t() + bias.double(), **KERNEL_TOLERANCE)
    monkeypatch.setattr(layout, "LARGE_WEIGHT_CHUNKED_ROWS", 16)
    layout.linear(x, prepared, bits, zero_point, bias)
    monkeypatch.setattr(layout, "LARGE_WEIGHT_CHUNKED_ROWS", 256)
    monkeypatch.setattr(layout, "LARGE_WEIGHT_BYTES", 2 * 128 * 96 + 1)
    layout.linear(x, prepared, bits, zero_point, bias)
    assert len(copies) == 2


def test_eight_bit_path_with_offsets_and_scales_kept_exact(fits, monkeypatch):
    monkeypatch.setattr(layout, "kernel_rows", lambda: layout.MAX_KERNEL_ROWS)  # the kernel to 32 rows, AMX or not
    generator = torch.Generator().manual_seed(1)
    q = torch.randint(-128, 128, (70, 96), dtype=torch.int8, generator=generator)
    scale = (torch.rand(70, 3, generator=generator) * 0.01).half()
    prepared = layout.pack(q, 8, scale)
    w = (q.float().view(70, 3, 32) * scale.float()[..., None]).reshape(70, 96)
    assert torch.equal(layout.dequantized_t(prepared, 8, 0).t(), w)
    bias = torch.randn(70).bfloat16()
    for rows in (1, 5, 8, 17, 32):  # from 5 rows: each block widened once to bfloat16 pairs (widen_block8)
        x = torch.randn(rows, 96).bfloat16()
        torch.testing.assert_close(layout.linear(x, prepared, 8, 0, bias).double(),
                                   x.double() @ w.double().t() + bias.double(), **KERNEL_TOLERANCE)


def test_float32_scales_whose_zero_term_would_round_are_refused(fits):
    n, _, zero, _ = _layer(32, 64, 32, symmetric=False)
    scale = torch.full((32, 2), 0.1 + 2 ** -30)  # 24 significant bits: zero * s needs more
    assert layout.pack(n, 4, scale, torch.full_like(zero, 3)) is None
    assert layout.pack(n, 4, scale.bfloat16(), zero) is not None


def test_bad_arguments_name_what_to_change(fits):
    n, scale, zero, _ = _layer(32, 64, 32, symmetric=False)
    prepared = layout.pack(n, 4, scale, zero)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        torch.ops.tengyun.quant_linear(torch.zeros(1, 64).bfloat16(), prepared["qpacked"], 3, 32,
                                       prepared["qscales"], None, None, 8.0, 32, None)
    with pytest.raises(RuntimeError, match="x must be a CPU bfloat16"):
        torch.ops.tengyun.quant_linear(torch.zeros(1, 64), prepared["qpacked"], 4, 32,
                                       prepared["qscales"], None, None, 8.0, 32, None)


def test_without_the_library_layers_keep_torchs_int4_layout(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load_error", lambda: "not built (test)")
    assert not layout.quant_gemv_fits()
    scheme = weight_only_scheme(4, 32, False)
    kernel = CpuPlatform().quant_linear_kernel(scheme, torch.bfloat16)
    assert not kernel.compiled
    assert isinstance(CpuPlatform().quant_linear_kernel(scheme_for_type("Q4_0"), torch.bfloat16),
                      CpuGgufInt4PackKernel)
    # torch's layout: in x out / 2 bytes and a scale and a zero term per group and output
    assert CpuPlatform.quantized_weight_bytes(scheme, 64, 128, "bfloat16") == 64 * 128 // 2 + 2 * 64 * 4 * 2
