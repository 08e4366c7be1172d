"""The small-batch linear kernel on oneDNN's packed weights (tengyun/csrc/packed_gemv.cpp,
platforms/cpu/kernels/linear.py) against F.linear in float32 (bfloat16 inputs widened exactly): float32
and bfloat16, output counts that are not multiples of the 16-column vector or the 64-column block,
odd K, 1-5 rows, with and without bias; both block widths oneDNN packs in (64; 32 for bfloat16 on
AMX cores) on weights laid out by hand, whatever this CPU's oneDNN picks; the routing by row
count; the layout check; and the fallbacks (oneDNN alone, or F.linear, when the kernels or oneDNN
are absent)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tengyun.layers import linear_kernel
from tengyun.platforms.cpu import native as cpu_kernels
from tengyun.layers.kernels import bind_kernels
from tengyun.layers.linear import ReplicatedLinear
from tengyun.layers.linear_kernel import DenseLinearKernel, OneDNNPackedLinearKernel, onednn_available
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.platforms.cpu.kernels.linear import (CpuPackedLinearKernel, PackedLinearWeight, amx_tiles_fit,
                                                  default_small_rows, small_batch_kernel_fits)
from tengyun.worker.worker import weight_bytes

from test_cpu_paged_attention import kernels  # noqa: F401 - the build-or-skip fixture

DTYPES = [torch.float32, torch.bfloat16]
# float32 sums in another order; bfloat16 adds one rounding of the result (2^-8 relative)
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2 ** -7, atol=2e-2)}


@pytest.fixture
def fits(kernels, request):  # noqa: F811
    dtype = request.node.callspec.params["dtype"]
    if not onednn_available(dtype) or not small_batch_kernel_fits(dtype):
        pytest.skip(f"this CPU or torch build does not run the small-batch kernel for {dtype}")
    return dtype


def _reference(x, weight, bias):
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (100, 577), (17, 33), (64, 2), (3, 7)])
# 12-64: several 4-row passes over each block, the later ones prefetching the next block
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 12, 16, 37, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_batch_kernel_matches_f_linear(fits, dtype, out_features, in_features, rows, with_bias):
    gen = torch.Generator().manual_seed(out_features * in_features + rows)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(rows, 2 * in_features, generator=gen).to(dtype)[:, ::2]  # strided rows: copied first
    kernel = CpuPackedLinearKernel(dtype, max_small_rows=64)
    prepared = kernel.prepare(weight)
    assert prepared.data_ptr is not None and kernel.rejected == 0  # the layout check passed
    out = kernel.apply(x, prepared, bias)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    torch.testing.assert_close(out.float(), _reference(x, weight, bias), **TOLERANCE[dtype])
    # the raw op on row views of one tensor (unit last stride, any row stride)
    wide = torch.randn(rows, in_features + 3, generator=gen).to(dtype)[:, :in_features]
    raw = torch.ops.tengyun.packed_gemv(wide, prepared.data_ptr, out_features, prepared.k_padded, bias,
                                        prepared.block)
    torch.testing.assert_close(raw.float(), _reference(wide, weight, bias), **TOLERANCE[dtype])


def _blocked(weight: torch.Tensor, block: int, k_padded: int) -> torch.Tensor:
    """weight [N, K] in oneDNN's blocked layout (packed_gemv.cpp), zero padded: float32
    [Npad / B, Kpad, B], bfloat16 [Npad / B, Kpad / 2, B, 2]."""
    n, k = weight.shape
    padded = F.pad(weight, (0, k_padded - k, 0, -n % block))
    blocks = padded.view(-1, block, k_padded)  # [Npad / B, B, Kpad]
    if weight.dtype == torch.float32:
        return blocks.transpose(1, 2).contiguous()
    return blocks.view(blocks.shape[0], block, k_padded // 2, 2).permute(0, 2, 1, 3).contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [64, 32])
@pytest.mark.parametrize("out_features,in_features", [(100, 65), (96, 576), (17, 33)])
def test_either_block_width_reads_a_weight_laid_out_by_hand(fits, dtype, block, out_features, in_features):
    """The layout oneDNN picks depends on the CPU (32-wide bfloat16 blocks where it packs for AMX):
    both widths, whichever this CPU's oneDNN uses, for the product and the tied embedding's rows."""
    gen = torch.Generator().manual_seed(block + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    k_padded = in_features + (in_features % 2 if dtype == torch.bfloat16 else 0) + 32
    blocked = _blocked(weight, block, k_padded)
    for rows in (1, 3, 16):
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        y = torch.ops.tengyun.packed_gemv(x, blocked.data_ptr(), out_features, k_padded, bias, block)
        torch.testing.assert_close(y.float(), _reference(x, weight, bias), **TOLERANCE[dtype])
    ids = torch.tensor([0, out_features - 1, block - 1 if block < out_features else 1, out_features // 2])
    rows = torch.ops.tengyun.packed_rows(ids, blocked.data_ptr(), out_features, in_features, k_padded, dtype, block)
    assert torch.equal(rows, weight[ids])
    with pytest.raises(RuntimeError, match="block must be 32 or 64"):
        torch.ops.tengyun.packed_gemv(x, blocked.data_ptr(), out_features, k_padded, bias, 48)


@pytest.mark.parametrize("dtype", DTYPES)
# chunks of whole blocks, a ragged last one; 3 and 9 blocks (SmolLM2's o projection): the last block
# over 2 threads, and 38 blocks' last 2 over 3, go by row parts
@pytest.mark.parametrize("out_features", [64 * 37 + 5, 64 * 3, 64 * 9])
def test_threads_sharing_the_blocks_out_compute_each_column_once(fits, dtype, out_features):
    """Threads claim chunks of blocks as they go (packed_gemv.cpp, gemv_all), and the last blocks
    that would not share out evenly by row parts: 1-3 threads give the same bits as each other (a
    column's sum is one thread's, in K order) and F.linear's values, for every row count."""
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, 96, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    prepared = CpuPackedLinearKernel(dtype).prepare(weight)
    if prepared.data_ptr is None:
        pytest.skip("oneDNN's packed layout here is not the kernel's")
    threads = torch.get_num_threads()
    try:
        for rows in (1, 5, 12, 37, 64):
            x = torch.randn(rows, 96, generator=gen).to(dtype)
            outs = []
            for count in (1, 2, 3):
                torch.set_num_threads(count)
                outs.append(torch.ops.tengyun.packed_gemv(x, prepared.data_ptr, out_features, prepared.k_padded,
                                                          bias, prepared.block))
            assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
            torch.testing.assert_close(outs[0].float(), _reference(x, weight, bias), **TOLERANCE[dtype])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_past_the_limit_run_onednn_and_agree(fits, dtype):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(200, 96, generator=gen).to(dtype)
    kernel = CpuPackedLinearKernel(dtype, max_small_rows=2)
    prepared = kernel.prepare(weight)
    x = torch.randn(7, 96, generator=gen).to(dtype)
    small = torch.cat([kernel.apply(x[i:i + 2], prepared, None) for i in range(0, 7, 2)])
    large = kernel.apply(x, prepared, None)  # 7 rows: oneDNN
    onednn = torch.ops.mkldnn._linear_pointwise(x, prepared.packed, None, "none", [], "")
    assert torch.equal(large, onednn)
    torch.testing.assert_close(small.float(), large.float(), **TOLERANCE[dtype])
    assert torch.ops.tengyun.packed_gemv(x[:0], prepared.data_ptr, 200, prepared.k_padded, None,
                                         prepared.block).shape == (0, 200)


@pytest.mark.parametrize("dtype", DTYPES)
def test_up_to_512_rows_run_the_small_batch_kernel_and_graphs_stop_at_64(fits, dtype, monkeypatch):
    """Where oneDNN packs 64-column blocks, the kernel takes up to 512 rows by default (ahead of
    oneDNN from 64 to 512 rows on an AMD EPYC, benchmarks/README.md): a 128-token prompt, or one
    prompt beside 64 decodes, runs it; the 513th row goes to oneDNN. Decode graphs are still
    captured for up to 64 sequences only (CpuPlatform.graph_batch_limit)."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(200, 96, generator=gen).to(dtype)
    kernel = CpuPackedLinearKernel(dtype, max_tile_rows=0)
    prepared = kernel.prepare(weight)
    if prepared.block != 64:
        pytest.skip("oneDNN packs this dtype in 32-column blocks here (AMX)")
    limit = kernel.max_small_rows
    assert limit == (64 if amx_tiles_fit() else 512)  # a CPU with AMX keeps 64 until measured there
    onednn_rows = []
    monkeypatch.setattr(OneDNNPackedLinearKernel, "apply", lambda self, x, w, b: onednn_rows.append(len(x)))
    x = torch.randn(limit + 1, 96, generator=gen).to(dtype)
    for rows in sorted({64, min(130, limit), limit}):
        torch.testing.assert_close(kernel.apply(x[:rows], prepared, None).float(),
                                   _reference(x[:rows], weight, None), **TOLERANCE[dtype])
    assert onednn_rows == []
    kernel.apply(x, prepared, None)
    assert onednn_rows == [limit + 1]
    bundle = SimpleNamespace(attention=SimpleNamespace(name="cpu_paged"), linear=kernel)
    assert kernel.graph_rows == 64 and CpuPlatform().graph_batch_limit(bundle) == 64


@pytest.mark.parametrize("dtype", [torch.float32])
def test_a_cpu_with_amx_keeps_64_rows_where_512_was_not_measured(fits, dtype, monkeypatch):
    """512 rows were measured on AMD EPYC only; where the CPU runs AMX tiles (the Intel machine
    type) a weight packed in 64-column blocks (float32) keeps the earlier 64."""
    from tengyun.platforms.cpu.kernels import linear as cpu_linear

    monkeypatch.setattr(cpu_linear, "amx_tiles_fit", lambda: True)
    assert CpuPackedLinearKernel(dtype).max_small_rows == 64
    monkeypatch.setattr(cpu_linear, "amx_tiles_fit", lambda: False)
    assert CpuPackedLinearKernel(dtype).max_small_rows == 512


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_a_weight_packed_for_amx_lowers_the_row_limit_to_4(fits, dtype, monkeypatch):
    """oneDNN's AMX kernels multiply 16 rows for the cost of one pass; the small kernel passes per 4
    rows. Whatever this CPU packs, a layout check that accepts 32-column blocks only (AMX's) stands
    in for such a CPU; the real layout decides too where this CPU has AMX."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(128, 64, generator=gen).to(dtype)
    native = CpuPackedLinearKernel(dtype)
    block = native.prepare(weight).block
    assert native.max_small_rows == (4 if block == 32 else default_small_rows(dtype))
    monkeypatch.setattr(CpuPackedLinearKernel, "_reads_like_onednn", lambda *args: args[-1] == 32)
    # (no AMX tiles: where they run, they take these rows before either limit applies)
    kernel = CpuPackedLinearKernel(dtype, max_tile_rows=0)
    given = CpuPackedLinearKernel(dtype, max_small_rows=16, max_tile_rows=0)
    assert kernel.max_small_rows == default_small_rows(dtype)
    assert kernel.prepare(weight).block == 32 and given.prepare(weight).block == 32
    assert kernel.max_small_rows == 4 and given.max_small_rows == 16  # a limit given is kept
    x = torch.randn(5, 64, generator=gen).to(dtype)  # 5 rows: past the limit, so oneDNN runs them
    prepared = kernel.prepare(weight)
    kernel._gemv = None  # any call of the small kernel now fails
    torch.testing.assert_close(kernel.apply(x, prepared, None).float(), _reference(x, weight, None),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layout_that_fails_the_check_runs_onednn_only(fits, dtype):
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(130, 64, generator=gen).to(dtype)
    kernel = CpuPackedLinearKernel(dtype)
    prepared = kernel.prepare(weight)
    # the same packed bytes read as if K were padded further: the check must see the difference
    assert not kernel._reads_like_onednn(prepared.packed, prepared.data_ptr, 130, 64, prepared.k_padded + 16,
                                         prepared.block)
    # ... or as if the blocks were the other width
    other_block = 96 - prepared.block  # 64 <-> 32
    assert not kernel._reads_like_onednn(prepared.packed, prepared.data_ptr, 130, 64, prepared.k_padded, other_block)
    # a weight of another dtype than the kernel's is packed but never read by the kernel
    other = CpuPackedLinearKernel(torch.float32 if dtype == torch.bfloat16 else torch.bfloat16)
    foreign = other.prepare(weight)
    assert foreign.data_ptr is None and other.rejected == 1
    x = torch.randn(1, 64, generator=gen).to(dtype)
    torch.testing.assert_close(other.apply(x, foreign, None).float(), _reference(x, weight, None),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features,in_features", [(1, 7), (1, 64)])
def test_a_single_output_column_computes_right_whichever_way_it_runs(fits, dtype, out_features, in_features):
    # oneDNN keeps a float32 [1, K] weight unblocked (the check then rejects it); bfloat16 blocks it
    weight = torch.randn(out_features, in_features).to(dtype)
    kernel = CpuPackedLinearKernel(dtype)
    prepared = kernel.prepare(weight)
    assert (prepared.data_ptr is None) == (kernel.rejected == 1)
    x = torch.randn(1, in_features).to(dtype)
    torch.testing.assert_close(kernel.apply(x, prepared, None).float(), _reference(x, weight, None),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_platform_binds_the_small_batch_kernel_and_counts_its_weight_once(fits, dtype):
    linear = ReplicatedLinear(48, 80, True, dtype)
    linear.weight.data.normal_()
    linear.bias.data.normal_()
    weight = linear.weight.data.clone()
    bundle = CpuPlatform().kernels(dtype, 16, "float32")
    assert isinstance(bundle.linear, CpuPackedLinearKernel)
    bind_kernels(linear, bundle)
    assert isinstance(linear.kernel_weight, PackedLinearWeight) and linear.weight.numel() == 0
    assert weight_bytes(linear) == 80 * 48 * weight.element_size() + linear.bias.nbytes
    x = torch.randn(1, 48).to(dtype)
    torch.testing.assert_close(linear(x).float(), _reference(x, weight, linear.bias), **TOLERANCE[dtype])


def test_without_the_compiled_kernels_linears_run_onednn_or_f_linear(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load_error", lambda: "not built (test)")
    assert not small_batch_kernel_fits(torch.float32)
    chosen = CpuPlatform().linear_kernel(torch.float32)
    assert type(chosen) is (OneDNNPackedLinearKernel if onednn_available(torch.float32) else DenseLinearKernel)
    monkeypatch.setattr(linear_kernel.torch.backends.mkldnn, "is_available", lambda: False)
    assert type(CpuPlatform().linear_kernel(torch.float32)) is DenseLinearKernel
    assert not small_batch_kernel_fits(torch.float16)
