"""Linear layers on CPU: oneDNN's prepacked weight for every batch, and for up to MAX_SMALL_ROWS rows
(decodes, a prompt of a few hundred tokens) the compiled small-batch kernel that reads the same
packed weight (tengyun/csrc/packed_gemv.cpp): oneDNN's M = 1 path streams the weight at ~36 GB/s
here, the kernel at ~50, which is most of a batch-1 decode step (``benchmarks/README.md``, "Batch-1
decode"); at 64-512 rows it still runs a few percent ahead.

One copy of the weight either way; a tied LM head's packed weight also serves the embedding's
lookups (``row_reader``: packed_gemv.cpp's packed_rows copies row n out of the blocks), so the
vocab x hidden matrix is held once. The kernel assumes oneDNN's blocked layout (64 output columns
per block, K-major inside; 32 for bfloat16 on cores with AMX, whose oneDNN kernels tile by 32);
``prepare`` tries each block width against oneDNN's own product and leaves a weight whose layout
differs (another CPU, another oneDNN) to oneDNN alone.

Where oneDNN packs bfloat16 for AMX, 1-128 rows (decode at batch 1-128, prompts of up to 128 tokens)
run a second compiled kernel on the same packed weight instead, AMX tiles with prefetch
(tengyun/csrc/amx_packed_gemm.cpp): at 16-32 rows oneDNN's AMX path reads the weight at 12-15 GB/s,
the kernel at ~20; at 1-4 rows it is also ahead of the small-batch kernel, at 72-128 1.1-1.3x oneDNN,
and it keeps decodes of up to 64 sequences in decode graphs (``benchmarks/README.md``, "AMX tiles for
1-64 rows" and "Sparser prefetch"). Each weight is checked against
oneDNN's product before any row runs there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tengyun.layers.linear_kernel import OneDNNPackedLinearKernel, RowReader

logger = logging.getLogger(__name__)

# Output columns per oneDNN block (packed_gemv.cpp), in the order tried: 64 on AVX-512 cores, 32 for
# bfloat16 where oneDNN packs for AMX (Sapphire Rapids and later). With 64 only, such a CPU ran every
# bfloat16 decode on oneDNN: SmolLM2 batch-1 steps of 25 ms instead of 12 (2026-12-02, benchmarks/README.md).
BLOCKS = (64, 32)
AMX_BLOCK = 32
# At most this many rows run the small-batch kernel; more run oneDNN. Up to 16 (2026-12-01/02:
# bfloat16 1.18-1.20x oneDNN at 8-16 rows, float32 1.01-1.11x at 1-16) until the kernel's later passes
# over a block streamed the next block into L2 (packed_gemv.cpp, Ahead); then on an AMD EPYC
# (2026-12-06, `benchmarks/linear_kernels.py --small-rows`, 2 threads) SmolLM2's projections ran
# 1.27-1.65x oneDNN in bfloat16 from 16 to 64 rows (64: 34.2 against 44.0 ms) and 1.14-1.28x in float32,
# Qwen2.5-Coder's 1.05-1.25x with its LM head, and 96-512 rows about level. So 64. Once the kernel
# gave a thread row parts of the blocks that do not share out (2026-12-07, AMD EPYC family 25, the
# same script with the two taking turns pass by pass), it was ahead at every count from 64 to 512:
# SmolLM2's projections 1.06-1.26x in bfloat16 and 1.04-1.11x in float32, Qwen2.5-Coder's with its LM
# head 1.02-1.07x in bfloat16. So 512: a 128-token prompt's projections (its first token) and the
# steps that add one prompt to 64 decodes run the kernel. Not measured on the AMX machine type, where
# bfloat16 packs in 32-column blocks and takes AMX_MAX_SMALL_ROWS instead, and float32 keeps the
# earlier 64 (AMX_CPU_SMALL_ROWS) until measured there.
MAX_SMALL_ROWS = {torch.float32: 512, torch.bfloat16: 512}
AMX_CPU_SMALL_ROWS = 64
# Decode graphs (a trace holds no oneDNN weight) are captured for decodes of up to this many sequences
# on the small-batch kernel: 64, the sizes traced while it took up to 64 rows (more sizes cost start-up
# time and memory; a decode of more sequences runs eagerly, on the same kernel).
SMALL_GRAPH_ROWS = 64
# Where oneDNN packs bfloat16 for AMX (32-column blocks), its AMX tiles multiply 8-16 rows for the
# cost of one pass over the weight, while the kernel makes a pass per 4 rows: --small-rows on
# 2026-12-03's AMX VM, oneDNN 17.4-18.1 ms at every count from 1 to 16, the kernel 12.1-12.2 at 1 and
# 4 rows, 19.6 at 8, 35.8 at 16 (Qwen2.5-Coder's 16-sequence decode at 0.62x vLLM's). So the first
# weight packed that way lowers the kernel's limit to this (unless a limit was given).
AMX_MAX_SMALL_ROWS = 4
# Up to this many rows run the AMX tile kernel on weights packed for AMX; more run oneDNN.
# benchmarks/linear_kernels.py --small-rows, 2026-12-05, AMX VM (benchmarks/README.md, "AMX tiles for
# 1-64 rows"): 1.3-2.2x oneDNN from 1 to 32 rows, 0.95-1.03x at 48-64, behind from 96. Once the kernel
# prefetched sparsely (2026-12-06, "Sparser prefetch"), 72-128 rows ran 1.1-1.3x oneDNN (SmolLM2's
# projections at 128 rows 20.4 against 22.9 ms, Qwen2.5-Coder's 61.6 against 73.8), and a 128-token
# Qwen2.5-Coder prompt prefilled in 94.8 against 103 ms.
AMX_TILE_ROWS = 128
# Decode graphs (a trace cannot hold oneDNN's weights) cover decodes of up to this many sequences where
# the tile kernel runs: 64, as before the tile kernel took 128 rows (more sizes to trace, not measured).
AMX_GRAPH_ROWS = 64
_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # of the largest |y|
_ROW_CHECK_CHUNK = 8192  # rows compared at a time when row_reader checks a packed copy


@dataclass(frozen=True)
class PackedLinearWeight:
    """oneDNN's packed weight [N, K], and where the small-batch kernel reads it."""

    packed: torch.Tensor  # opaque oneDNN tensor; owns the memory data_ptr points into
    out_features: int
    k_padded: int  # K rounded up as oneDNN stored it
    data_ptr: int | None  # None: the layout check failed, oneDNN runs every batch
    block: int = BLOCKS[0]  # output columns per packed block
    tiles: bool = False  # the AMX tile kernel reads it (bfloat16, 32-column blocks, K % 32 == 0, checked)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed]


def small_batch_kernel_fits(dtype: torch.dtype) -> bool:
    """Whether the compiled kernels are loaded and this CPU runs the small-batch kernel for dtype
    (AVX-512; bfloat16 also needs AVX-512 BF16)."""
    from tengyun.platforms.cpu import native

    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(dtype)
    return (name is not None and native.load_error() is None
            and bool(torch.ops.tengyun.packed_gemv_supported(name)))


def amx_tiles_fit() -> bool:
    """Whether the compiled kernels are loaded and this CPU (and OS) runs the AMX tile kernel."""
    from tengyun.platforms.cpu import native

    return native.load_error() is None and bool(torch.ops.tengyun.amx_packed_gemm_supported())


def default_small_rows(dtype: torch.dtype) -> int:
    """The small-batch kernel's row limit on this CPU: MAX_SMALL_ROWS (measured on AMD EPYC), or
    AMX_CPU_SMALL_ROWS where the CPU runs AMX tiles (the Intel machine type; not measured past 64)."""
    return min(MAX_SMALL_ROWS[dtype], AMX_CPU_SMALL_ROWS) if amx_tiles_fit() else MAX_SMALL_ROWS[dtype]


class CpuPackedLinearKernel(OneDNNPackedLinearKernel):
    """oneDNN for every batch, the small-batch kernel for up to ``max_small_rows`` rows, and on weights
    packed for AMX the tile kernel for up to ``max_tile_rows``. Make only where
    small_batch_kernel_fits(dtype)."""

    def __init__(self, dtype: torch.dtype, max_small_rows: int | None = None, batch_size_hint: int = 64,
                 max_tile_rows: int | None = None):
        super().__init__(batch_size_hint)
        self.dtype = dtype
        self.max_small_rows = default_small_rows(dtype) if max_small_rows is None else max_small_rows
        self._limit_given = max_small_rows is not None
        self.max_tile_rows = 0  # rows the AMX tile kernel takes: set by the first weight it reads
        self._tile_graph_rows = 0  # of those, the rows decode graphs are captured for
        self._tile_rows = AMX_TILE_ROWS if max_tile_rows is None else max_tile_rows
        self._tiles = dtype == torch.bfloat16 and self._tile_rows > 0 and amx_tiles_fit()
        self.rejected = 0  # weights whose packed layout failed the check (tests, logs)
        self._gemv = torch.ops.tengyun.packed_gemv.default  # resolved once (~0.6 us a call)
        self._tile_gemm = torch.ops.tengyun.amx_packed_gemm.default

    def prepare(self, weight: torch.Tensor) -> PackedLinearWeight:
        packed = super().prepare(weight)
        out_features, k = weight.shape
        if weight.dtype == self.dtype:
            ptr = torch.ops.mkldnn.data_ptr(packed)
            for block in BLOCKS:
                k_padded = _k_padded(packed, out_features, weight.element_size(), block)
                if k_padded is not None and self._reads_like_onednn(packed, ptr, out_features, k, k_padded, block):
                    if block == AMX_BLOCK and not self._limit_given and self.max_small_rows > AMX_MAX_SMALL_ROWS:
                        logger.info("oneDNN packs %s weights for AMX: the small-batch kernel takes up to %d rows, "
                                    "%s", weight.dtype, AMX_MAX_SMALL_ROWS,
                                    f"AMX tiles up to {self._tile_rows}, oneDNN more" if self._tiles else "oneDNN more")
                        self.max_small_rows = AMX_MAX_SMALL_ROWS
                    tiles = block == AMX_BLOCK and self._tiles_read_like_onednn(packed, ptr, out_features, k, k_padded)
                    if tiles:
                        self.max_tile_rows = self._tile_rows
                        self._tile_graph_rows = min(self._tile_rows, AMX_GRAPH_ROWS)
                    return PackedLinearWeight(packed, out_features, k_padded, ptr, block, tiles)
        self.rejected += 1
        if self.rejected == 1:
            logger.info("oneDNN packed a %s [%d, %d] weight in a layout the small-batch kernel does not "
                        "read; such layers run oneDNN at every batch size", weight.dtype, out_features, k)
        return PackedLinearWeight(packed, out_features, k, None)

    @property
    def graph_rows(self) -> int:
        """The decode batch sizes graphs are captured for: up to SMALL_GRAPH_ROWS on the small-batch
        kernel, up to AMX_GRAPH_ROWS where the AMX tile kernel runs (above: eager)."""
        return max(min(self.max_small_rows, SMALL_GRAPH_ROWS), self._tile_graph_rows)

    def apply(self, x: torch.Tensor, weight: PackedLinearWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] -> [M, N]: the AMX tile kernel when the weight is packed for it and M <=
        max_tile_rows, else the small-batch kernel when M <= max_small_rows, else oneDNN."""
        if weight.data_ptr is not None and x.dim() == 2:
            tiles = weight.tiles and x.shape[0] <= self.max_tile_rows
            if tiles or x.shape[0] <= self.max_small_rows:
                x = x if x.stride(-1) == 1 else x.contiguous()
                if tiles:
                    return self._tile_gemm(x, weight.data_ptr, weight.out_features, weight.k_padded, bias)
                return self._gemv(x, weight.data_ptr, weight.out_features, weight.k_padded, bias, weight.block)
        return super().apply(x, weight.packed, bias)

    def row_reader(self, prepared: PackedLinearWeight, original: torch.Tensor) -> RowReader | None:
        """ids [T] -> rows [T, K] read from the packed copy, once every row read back equals
        ``original`` [N, K] bit for bit; None where the layout check failed or a row differs."""
        if prepared.data_ptr is None or original.dtype != self.dtype or original.dim() != 2:
            return None
        return checked_packed_row_reader(prepared.data_ptr, original, prepared.k_padded, prepared.block,
                                         f"oneDNN's packed {self.dtype}")

    def _reads_like_onednn(self, packed: torch.Tensor, ptr: int, out_features: int, k: int, k_padded: int,
                           block: int) -> bool:
        """The kernel's product on 3 random rows equals oneDNN's, within float32 summation order."""
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(0)).to(self.dtype)
        return self._agrees_with_onednn(packed, x, torch.ops.tengyun.packed_gemv(x, ptr, out_features, k_padded,
                                                                                 None, block))

    def _tiles_read_like_onednn(self, packed: torch.Tensor, ptr: int, out_features: int, k: int,
                                k_padded: int) -> bool:
        """The AMX tile kernel's product equals oneDNN's on 7 rows (fewer than a tile) and 37 (two
        passes, the last group overlapping), within float32 summation order; False where the kernel
        does not run (no AMX, K or Kpad not a multiple of 32)."""
        if not self._tiles or k % 32 or k_padded % 32:
            return False
        generator = torch.Generator().manual_seed(1)
        for rows in (7, 37):
            x = torch.randn(rows, k, generator=generator).to(self.dtype)
            if not self._agrees_with_onednn(packed, x, self._tile_gemm(x, ptr, out_features, k_padded, None)):
                logger.info("The AMX tile kernel's product on a packed %s [%d, %d] weight differs from oneDNN's; "
                            "its 5-%d-row batches run oneDNN", self.dtype, out_features, k, self._tile_rows)
                return False
        return True

    def _agrees_with_onednn(self, packed: torch.Tensor, x: torch.Tensor, got: torch.Tensor) -> bool:
        """got (a compiled kernel's x [M, K] @ W^T) equals oneDNN's product on the packed W within
        float32 summation order: the largest difference, relative to the largest |y|."""
        want = super().apply(x, packed, None).float()
        scale = want.abs().max().clamp_min(1e-30)
        return bool(((got.float() - want).abs().max() / scale) <= _CHECK_TOLERANCE[self.dtype])


def checked_packed_row_reader(data_ptr: int, original: torch.Tensor, k_padded: int, block: int,
                              what: str) -> RowReader | None:
    """ids [T] -> rows [T, K] copied by packed_gemv.cpp's packed_rows out of a weight packed in
    ``block``-column blocks of K (pairs for bfloat16) at ``data_ptr``, once every row read back
    equals ``original`` [N, K] bit for bit; None (and one log line naming ``what``) where one differs."""
    out_features, k = original.shape
    packed_rows = torch.ops.tengyun.packed_rows.default

    def read(ids: torch.Tensor) -> torch.Tensor:
        rows = packed_rows(ids.reshape(-1), data_ptr, out_features, k, k_padded, original.dtype, block)
        return rows.view(*ids.shape, k)

    for start in range(0, out_features, _ROW_CHECK_CHUNK):
        ids = torch.arange(start, min(start + _ROW_CHECK_CHUNK, out_features))
        if not torch.equal(read(ids), original[start:start + len(ids)]):
            logger.info("%s [%d, %d] weight does not read back row for row; the tied embedding keeps its "
                        "own copy", what, out_features, k)
            return None
    return read


def _k_padded(packed: torch.Tensor, out_features: int, element_size: int, block: int) -> int | None:
    """K as oneDNN padded it, from the packed size ([ceil(N / block) * block, Kpad]); None when the
    size does not fit that layout."""
    n_padded = -(-out_features // block) * block
    nbytes = torch.ops.mkldnn._nbytes(packed)
    if nbytes % (n_padded * element_size):
        return None
    k_padded = nbytes // (n_padded * element_size)
    pairs = element_size == 2  # 16-bit weights are stored in (k, k + 1) pairs
    return k_padded if k_padded >= packed.shape[1] and not (pairs and k_padded % 2) else None
