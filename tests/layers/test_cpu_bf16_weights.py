"""The bfloat16-weight linear kernel for cores without bfloat16 arithmetic (tengyun/csrc/bf16_weight_gemm.cpp,
platforms/cpu/kernels/bf16_weights.py) against F.linear in float32 on the same bfloat16 weight
(exact widening): bfloat16 and float32 x, odd K, output counts that are not multiples of the
16-column block, 1 row to three 64-row blocks, strided rows, with and without bias; the packing; the
tied embedding's rows read from the packed copy; its errors; and the kernel choice on a CPU where
oneDNN packs no bfloat16 weight. Its AVX2 copy runs on AVX-512 CPUs too, so this runs
wherever the kernels build."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tengyun.platforms.cpu.kernels import choice
from tengyun.platforms.cpu.kernels.bf16_weights import CpuBf16WeightKernel, bf16_weight_kernel_fits, pack_weight
from tengyun.platforms.kernel_choice import KernelQuery, choose

from test_cpu_paged_attention import kernels  # noqa: F401 - the build-or-skip fixture

# float32 sums in another order (up to 1536 products of N(0, 1) values, sums of ~40: 1.2e-4 apart seen
# on an AMD EPYC with AVX-512, where F.linear sums in another order than on AVX2); a bfloat16 result
# adds one rounding (2^-8 relative)
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=5e-4), torch.bfloat16: dict(rtol=2 ** -7, atol=2e-2)}


@pytest.fixture
def fits(kernels):  # noqa: F811
    if not bf16_weight_kernel_fits():
        pytest.skip("this CPU does not run the AVX2 bfloat16-weight kernel")


def _reference(x, weight, bias):
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (100, 577), (17, 33), (5, 7)])
# 1-4: one pass; 5-64: several 4-row passes over each weight block; 130: three 64-row blocks
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 64, 130])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_f_linear(fits, x_dtype, out_features, in_features, rows, with_bias):
    gen = torch.Generator().manual_seed(out_features * in_features + rows)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(x_dtype) if with_bias else None
    x = torch.randn(rows, 2 * in_features, generator=gen).to(x_dtype)[:, ::2]  # strided rows: copied first
    kernel = CpuBf16WeightKernel()
    prepared = kernel.prepare(weight)
    out = kernel.apply(x, prepared, bias)
    assert out.dtype == x_dtype and out.shape == (rows, out_features)
    torch.testing.assert_close(out.float(), _reference(x, weight, bias), **TOLERANCE[x_dtype])
    # the raw op on row views of one tensor (unit last stride, any row stride)
    wide = torch.randn(rows, in_features + 3, generator=gen).to(x_dtype)[:, :in_features]
    raw = torch.ops.tengyun.bf16_weight_gemm(wide, pack_weight(weight), out_features, bias)  # padded too
    torch.testing.assert_close(raw.float(), _reference(wide, weight, bias), **TOLERANCE[x_dtype])


@pytest.mark.parametrize("out_features,in_features", [(100, 33), (16, 2), (3, 1), (49, 64)])
def test_packing_places_each_weight_and_unpacks_exactly(out_features, in_features):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    packed = pack_weight(weight)
    assert packed.shape == (-(-out_features // 16), -(-in_features // 2), 16, 2)
    n, k = out_features - 1, in_features - 1
    assert packed[n // 16, k // 2, n % 16, k % 2] == weight[n, k]
    unpacked = packed.permute(0, 2, 1, 3).reshape(packed.shape[0] * 16, packed.shape[1] * 2)
    assert torch.equal(unpacked[:out_features, :in_features], weight)
    assert not unpacked[out_features:].any() and not unpacked[:, in_features:].any()  # zero padding


def test_a_tied_embedding_reads_rows_from_the_packed_copy(fits):
    weight = torch.randn(208, 34, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    kernel = CpuBf16WeightKernel()
    prepared = kernel.prepare(weight)
    read = kernel.row_reader(prepared, weight)
    ids = torch.tensor([[0, 207], [15, 16]])
    assert torch.equal(read(ids), F.embedding(ids, weight))
    assert torch.equal(read(torch.arange(208)), weight)
    assert kernel.row_reader(prepared, weight.float()) is None  # not the weight it packed


def test_bfloat16_results_round_to_nearest_even(fits):
    """One rounding of the float32 sum, as torch's conversion rounds: bit for bit where the float32
    sums agree (a sum of one product has one order)."""
    weight = torch.randn(64, 1).to(torch.bfloat16)
    x = torch.randn(3, 1).to(torch.bfloat16)
    got = torch.ops.tengyun.bf16_weight_gemm(x, pack_weight(weight), 64, None)
    want = (x.float() @ weight.float().T).to(torch.bfloat16)
    assert torch.equal(got, want)


def test_leading_dimensions_and_zero_rows(fits):
    weight = torch.randn(10, 16).to(torch.bfloat16)
    kernel = CpuBf16WeightKernel()
    prepared = kernel.prepare(weight)
    x = torch.randn(2, 3, 16).to(torch.bfloat16)
    out = kernel.apply(x, prepared, None)
    assert out.shape == (2, 3, 10)
    torch.testing.assert_close(out.float(), _reference(x, weight, None), **TOLERANCE[torch.bfloat16])
    assert kernel.apply(torch.zeros(0, 16, dtype=torch.bfloat16), prepared, None).shape == (0, 10)


@pytest.mark.parametrize("bad,match", [
    (dict(packed=pack_weight(torch.zeros(4, 8, dtype=torch.bfloat16)).float()), "packed must be a contiguous bfloat16"),
    (dict(packed=pack_weight(torch.zeros(4, 10, dtype=torch.bfloat16))), r"N = 4 and x's K = 8"),
    (dict(n=17), r"N = 17"),
    (dict(x=torch.zeros(2, 8, dtype=torch.float16)), "x must be a CPU float32 or bfloat16"),
    (dict(bias=torch.zeros(3, dtype=torch.bfloat16)), "bias must be a contiguous"),
])
def test_op_names_what_is_wrong(fits, bad, match):
    args = dict(x=torch.zeros(2, 8, dtype=torch.bfloat16), packed=pack_weight(torch.zeros(4, 8, dtype=torch.bfloat16)),
                n=4, bias=None)
    args.update(bad)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.tengyun.bf16_weight_gemm(args["x"], args["packed"], args["n"], args["bias"])


@pytest.mark.parametrize("shape", [(100, 64), (64, 33)])
def test_a_weight_the_blocks_would_pad_stays_as_loaded(fits, shape):
    """N not a multiple of 16, or odd K: no padded copy (the plan counts N x K x 2 bytes); F.linear
    multiplies the loaded weight."""
    weight = torch.randn(*shape).to(torch.bfloat16)
    kernel = CpuBf16WeightKernel()
    prepared = kernel.prepare(weight)
    assert prepared is weight and kernel.row_reader(prepared, weight) is None
    x = torch.randn(3, shape[1]).to(torch.bfloat16)
    assert torch.equal(kernel.apply(x, prepared, None), F.linear(x, weight))


def test_prepare_refuses_other_weights(fits):
    with pytest.raises(ValueError, match="2-D bfloat16 weights"):
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
