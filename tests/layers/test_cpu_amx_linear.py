"""The AMX tile kernel on oneDNN's bfloat16 weights packed for AMX (tengyun/csrc/amx_packed_gemm.cpp,
platforms/cpu/kernels/linear.py) against F.linear in float32: fewer rows than a tile, a whole tile,
row groups whose last one overlaps the one before, two and four passes over a block (each pass
prefetching a share of the next block); output counts that are
not multiples of the 16-column half or the 32-column block; with and without bias; strided rows;
the weight laid out by hand (whatever this CPU's oneDNN picks) and as oneDNN packs it here; the
routing by row count, and the weights the kernel must leave to the others (K not a multiple of 32).
Runs only where the CPU has AMX-BF16 and the OS grants the tiles."""

from __future__ import annotations

import pytest
import torch

from tengyun.layers.linear_kernel import onednn_available
from tengyun.platforms.cpu.kernels import linear as cpu_linear
from tengyun.platforms.cpu.kernels.linear import CpuPackedLinearKernel, amx_tiles_fit

from test_cpu_paged_attention import kernels  # noqa: F401 - the build-or-skip fixture
from test_cpu_linear import TOLERANCE, _blocked, _reference

BF16 = torch.bfloat16


@pytest.fixture
def tiles(kernels):  # noqa: F811
    if not amx_tiles_fit():
        pytest.skip("this CPU or OS does not run AMX tiles")


@pytest.mark.parametrize("out_features,in_features", [(100, 64), (32, 576), (960, 576), (17, 96)])
@pytest.mark.parametrize("rows", [1, 5, 16, 21, 32, 37, 64, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_tiles_on_a_weight_laid_out_by_hand_match_f_linear(tiles, out_features, in_features, rows, with_bias):
    gen = torch.Generator().manual_seed(out_features + rows)
    weight = torch.randn(out_features, in_features, generator=gen).to(BF16)
    bias = torch.randn(out_features, generator=gen).to(BF16) if with_bias else None
    k_padded = in_features + 32  # padding the kernel must skip, block to block
    blocked = _blocked(weight, 32, k_padded)
    x = torch.randn(rows, in_features + 8, generator=gen).to(BF16)[:, :in_features]  # row stride != K
    y = torch.ops.tengyun.amx_packed_gemm(x, blocked.data_ptr(), out_features, k_padded, bias)
    assert y.dtype == BF16 and y.shape == (rows, out_features)
    torch.testing.assert_close(y.float(), _reference(x, weight, bias), **TOLERANCE[BF16])


def test_tiles_refuse_what_they_cannot_read(tiles):
    weight = _blocked(torch.randn(64, 96).to(BF16), 32, 96)
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        torch.ops.tengyun.amx_packed_gemm(torch.randn(3, 80).to(BF16), weight.data_ptr(), 64, 96, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.tengyun.amx_packed_gemm(torch.randn(3, 96), weight.data_ptr(), 64, 96, None)
    empty = torch.ops.tengyun.amx_packed_gemm(torch.randn(0, 96).to(BF16), weight.data_ptr(), 64, 96, None)
    assert empty.shape == (0, 64)


def _packed_for_amx(weight):
    if not onednn_available(BF16):
        pytest.skip("this torch build has no oneDNN")
    kernel = CpuPackedLinearKernel(BF16)
    prepared = kernel.prepare(weight)
    if prepared.block != 32:
        pytest.skip("oneDNN does not pack bfloat16 for AMX on this CPU")
    return kernel, prepared


def test_weights_onednn_packs_for_amx_run_tiles_up_to_the_limit_and_onednn_past_it():
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(200, 576, generator=gen).to(BF16)
    bias = torch.randn(200, generator=gen).to(BF16)
    kernel, prepared = _packed_for_amx(weight)
    assert prepared.tiles and kernel.max_tile_rows == cpu_linear.AMX_TILE_ROWS
    for rows in (1, 4, 5, kernel.max_tile_rows):
        x = torch.randn(rows, 576, generator=gen).to(BF16)
        torch.testing.assert_close(kernel.apply(x, prepared, bias).float(), _reference(x, weight, bias),
                                   **TOLERANCE[BF16])
    x = torch.randn(kernel.max_tile_rows + 1, 576, generator=gen).to(BF16)
    kernel._tile_gemm = kernel._gemv = None  # past the limit neither compiled kernel may run
    onednn = torch.ops.mkldnn._linear_pointwise(x, prepared.packed, bias, "none", [], "")
    assert torch.equal(kernel.apply(x, prepared, bias), onednn)


def test_the_tiles_take_128_rows_and_decode_graphs_stop_at_64_sequences():
    """A 128-token prompt runs the tile kernel (1.1-1.3x oneDNN at 72-128 rows), while decode graphs
    are still captured up to 64 sequences only (CpuPlatform.graph_batch_limit)."""
    from types import SimpleNamespace

    from tengyun.platforms.cpu.platform import CpuPlatform

    kernel, prepared = _packed_for_amx(torch.randn(64, 96).to(BF16))
    assert prepared.tiles and (kernel.max_tile_rows, kernel.graph_rows) == (128, 64)
    tile_gemm, calls = kernel._tile_gemm, []
    kernel._tile_gemm = lambda *args: calls.append(args[0].shape[0]) or tile_gemm(*args)
    kernel.apply(torch.randn(128, 96).to(BF16), prepared, None)
    assert calls == [128]  # the prompt's 128 rows ran the tile kernel, not oneDNN
    bundle = SimpleNamespace(attention=SimpleNamespace(name="cpu_paged"), linear=kernel)
    assert CpuPlatform.graph_batch_limit(CpuPlatform.__new__(CpuPlatform), bundle) == 64


def test_within_the_limit_the_tiles_run_and_not_the_small_batch_kernel():
    weight = torch.randn(64, 96).to(BF16)
    kernel, prepared = _packed_for_amx(weight)
    kernel._gemv = None  # any call of the small-batch kernel now fails
    x = torch.randn(3, 96).to(BF16)
    torch.testing.assert_close(kernel.apply(x, prepared, None).float(), _reference(x, weight, None),
                               **TOLERANCE[BF16])


def test_a_weight_whose_k_is_not_a_multiple_of_32_is_left_to_the_other_kernels():
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(64, 100, generator=gen).to(BF16)
    kernel, prepared = _packed_for_amx(weight)
    assert not prepared.tiles
    kernel._tile_gemm = None
    for rows in (2, 9):  # the small-batch kernel, then oneDNN
        x = torch.randn(rows, 100, generator=gen).to(BF16)
        torch.testing.assert_close(kernel.apply(x, prepared, None).float(), _reference(x, weight, None),
                                   **TOLERANCE[BF16])


def test_a_tile_product_that_differs_from_onednn_keeps_the_weight_off_the_tiles(monkeypatch):
    weight = torch.randn(64, 96).to(BF16)
    _packed_for_amx(weight)  # skips where oneDNN does not pack for AMX
    kernel = CpuPackedLinearKernel(BF16)
    real = kernel._tile_gemm
    kernel._tile_gemm = lambda *args: real(*args) * 1.5  # a layout the kernel misreads
    prepared = kernel.prepare(weight)
    assert prepared.data_ptr is not None and not prepared.tiles and kernel.max_tile_rows == 0
    x = torch.randn(9, 96).to(BF16)
    torch.testing.assert_close(kernel.apply(x, prepared, None).float(), _reference(x, weight, None),
                               **TOLERANCE[BF16])


def test_a_tile_limit_of_zero_turns_the_tiles_off():
    weight = torch.randn(64, 96).to(BF16)
    _packed_for_amx(weight)
    kernel = CpuPackedLinearKernel(BF16, max_tile_rows=0)
    assert not kernel.prepare(weight).tiles and kernel.max_tile_rows == 0
