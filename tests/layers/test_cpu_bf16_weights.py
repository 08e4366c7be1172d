"""The bfloat16-weight linear kernel for cores without bfloat16 arithmetic (tengyun/csrc/bf16_weight_gemm.cpp,
platforms/cpu/kernels/bf16_weights.py) against F.linear in float32 on the same bfloat16 weight
(exact widening): bfloat16 and float32 x, K not a multiple of the 8-lane vector, output counts that
are not multiples of a tile, 1 row to two 64-row blocks, strided rows, with and without bias; its
errors; and the kernel choice on a CPU where oneDNN packs no bfloat16 weight. Its AVX2 copy runs on
AVX-512 CPUs too, so this runs wherever the kernels build."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tengyun.platforms.cpu.kernels import bf16_weights, choice
from tengyun.platforms.cpu.kernels.bf16_weights import MAX_KERNEL_ROWS, CpuBf16WeightKernel, bf16_weight_kernel_fits
from tengyun.platforms.kernel_choice import KernelQuery, choose

from test_cpu_paged_attention import kernels  # noqa: F401 - the build-or-skip fixture

# float32 sums in another order; a bfloat16 result adds one rounding (2^-8 relative)
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2 ** -7, atol=2e-2)}


@pytest.fixture
def fits(kernels):  # noqa: F811
    if not bf16_weight_kernel_fits():
        pytest.skip("this CPU does not run the AVX2 bfloat16-weight kernel")


def _reference(x, weight, bias):
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (100, 577), (17, 33), (5, 7)])
# 1-4: one pass; 5-64: several 4-row passes over each weight tile; 130: three 64-row blocks (the raw
# op; the layer widens the weight above MAX_KERNEL_ROWS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 64, 130])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_f_linear(fits, x_dtype, out_features, in_features, rows, with_bias):
    gen = torch.Generator().manual_seed(out_features * in_features + rows)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(x_dtype) if with_bias else None
    x = torch.randn(rows, 2 * in_features, generator=gen).to(x_dtype)[:, ::2]  # strided rows: copied first
    kernel = CpuBf16WeightKernel()
    prepared = kernel.prepare(weight)
    assert prepared.data_ptr() == weight.data_ptr()  # the loaded weight itself, no copy
    out = kernel.apply(x, prepared, bias)
    assert out.dtype == x_dtype and out.shape == (rows, out_features)
    torch.testing.assert_close(out.float(), _reference(x, weight, bias), **TOLERANCE[x_dtype])
    # the raw op on row views of one tensor (unit last stride, any row stride)
    wide = torch.randn(rows, in_features + 3, generator=gen).to(x_dtype)[:, :in_features]
    raw = torch.ops.tengyun.bf16_weight_gemm(wide, weight, bias)
    torch.testing.assert_close(raw.float(), _reference(wide, weight, bias), **TOLERANCE[x_dtype])


@pytest.mark.parametrize("chunk", [bf16_weights.WIDEN_CHUNK_ELEMENTS, 33 * 7])
def test_more_rows_widen_the_weight_in_chunks(fits, monkeypatch, chunk):
    """Above MAX_KERNEL_ROWS the weight is widened and F.linear runs in float32, a chunk of weight
    rows at a time (7 rows of 33 here: 100 outputs in 15 chunks, the last one short)."""
    monkeypatch.setattr(bf16_weights, "WIDEN_CHUNK_ELEMENTS", chunk)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(100, 33, generator=gen).to(torch.bfloat16)
    bias = torch.randn(100, generator=gen).to(torch.bfloat16)
    x = torch.randn(MAX_KERNEL_ROWS + 1, 33, generator=gen).to(torch.bfloat16)
    want, calls, linear = _reference(x, weight, bias), [], F.linear
    monkeypatch.setattr(F, "linear", lambda *a: calls.append(a[1].shape) or linear(*a))
    out = CpuBf16WeightKernel().apply(x, weight, bias)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, **TOLERANCE[torch.bfloat16])
    assert calls == ([(100, 33)] if chunk > 3300 else [(7, 33)] * 14 + [(2, 33)])


def test_bfloat16_results_round_to_nearest_even(fits):
    """One rounding of the float32 sum, as torch's conversion rounds: bit for bit where the float32
    sums agree (a sum of one product has one order)."""
    weight = torch.randn(64, 1).to(torch.bfloat16)
    x = torch.randn(3, 1).to(torch.bfloat16)
    got = torch.ops.tengyun.bf16_weight_gemm(x, weight, None)
    want = (x.float() @ weight.float().T).to(torch.bfloat16)
    assert torch.equal(got, want)


def test_leading_dimensions_and_zero_rows(fits):
    weight = torch.randn(10, 16).to(torch.bfloat16)
    kernel = CpuBf16WeightKernel()
    x = torch.randn(2, 3, 16).to(torch.bfloat16)
    out = kernel.apply(x, kernel.prepare(weight), None)
    assert out.shape == (2, 3, 10)
    torch.testing.assert_close(out.float(), _reference(x, weight, None), **TOLERANCE[torch.bfloat16])
    assert kernel.apply(torch.zeros(0, 16, dtype=torch.bfloat16), weight, None).shape == (0, 10)


@pytest.mark.parametrize("bad,match", [
    (dict(weight=torch.zeros(4, 8)), "weight must be a contiguous bfloat16"),
    (dict(weight=torch.zeros(4, 9, dtype=torch.bfloat16)), r"with x's K \(8\)"),
    (dict(x=torch.zeros(2, 8, dtype=torch.float16)), "x must be a CPU float32 or bfloat16"),
    (dict(bias=torch.zeros(3, dtype=torch.bfloat16)), "bias must be a contiguous"),
])
def test_op_names_what_is_wrong(fits, bad, match):
    args = dict(x=torch.zeros(2, 8, dtype=torch.bfloat16), weight=torch.zeros(4, 8, dtype=torch.bfloat16), bias=None)
    args.update(bad)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.tengyun.bf16_weight_gemm(args["x"], args["weight"], args["bias"])


def test_prepare_refuses_other_weights(fits):
    with pytest.raises(ValueError, match="bfloat16 weights"):
        CpuBf16WeightKernel().prepare(torch.zeros(4, 8))


def test_chosen_for_bfloat16_where_onednn_packs_none(fits, monkeypatch):
    """On a CPU where oneDNN packs no bfloat16 weight (AVX2 without AVX-512), bfloat16 linears take
    this kernel instead of F.linear's bfloat16 GEMM; float32 still takes oneDNN."""
    monkeypatch.setattr(choice, "_why_not_onednn", lambda q: f"oneDNN's packed linear does not run {q.dtype}")
    monkeypatch.setattr(choice, "_why_not_small_batch", lambda q: "no AVX-512 here")
    candidates = choice.cpu_candidates("linear", lambda: False)
    bf16 = choose("linear", candidates, KernelQuery("bfloat16"))
    assert bf16.name == "cpu_bf16_weights"
    assert isinstance(bf16.candidate.build(KernelQuery("bfloat16")), CpuBf16WeightKernel)
    assert choose("linear", candidates + [_dense()], KernelQuery("float32")).name == "dense"


def _dense():
    from tengyun.platforms.kernel_choice import KernelCandidate, always

    return KernelCandidate("dense", always, lambda q: None)
