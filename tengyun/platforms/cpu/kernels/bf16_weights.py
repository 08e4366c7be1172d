"""bfloat16 linear layers on cores without bfloat16 arithmetic (AVX2 + FMA, no AVX512-BF16).

There oneDNN does not pack a bfloat16 weight (its reorder needs AVX512 BW/VL/DQ or AVX-NE-CONVERT)
and F.linear's own bfloat16 GEMM ran at ~19 GFLOP/s on 2 cores of an AMD EPYC without AVX-512,
against ~135 for float32 (2026-12-07, benchmarks/README.md "An AVX2 machine"). The compiled kernel
(tengyun/csrc/bf16_weight_gemm.cpp) reads the weight packed once in 16-column blocks of K pairs,
widens it to float32 in registers and sums in float32: a decode step streams half the bytes float32
would, and every batch (decode or prefill) runs it: 2.2x oneDNN float32 at 1-4 rows, level at
64-256, ~0.8x at 512.

A tied LM head's packed weight also serves the embedding's lookups (packed_gemv.cpp's packed_rows
reads the same layout in 16-column blocks), so the vocab x hidden matrix is held once at TP = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tengyun.layers.linear_kernel import DenseLinearKernel, RowReader
from tengyun.platforms.cpu.kernels.linear import checked_packed_row_reader

BLOCK = 16  # output columns per packed block (bf16_weight_gemm.cpp)
# Decode graphs (cpu/runtime/graphs.py) are captured for decodes of up to this many sequences:
# every batch runs the compiled op, which a trace holds, as with the small-batch kernel's 64.
GRAPH_ROWS = 64


def bf16_weight_kernel_fits() -> bool:
    """Whether the compiled kernels are loaded and this CPU runs the AVX2 bfloat16-weight kernel."""
    from tengyun.platforms.cpu import native

    return native.load_error() is None and bool(torch.ops.tengyun.bf16_weight_gemm_supported())


@dataclass(frozen=True)
class PackedBf16Weight:
    """A bfloat16 [N, K] weight packed for bf16_weight_gemm: [ceil(N / 16), ceil(K / 2), 16, 2]."""

    packed: torch.Tensor
    out_features: int
    in_features: int

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed]


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """bfloat16 [N, K] -> [ceil(N / 16), ceil(K / 2), 16, 2], zero padded: element (n, k) at
    [n // 16, k // 2, n % 16, k % 2] (bf16_weight_gemm.cpp)."""
    n, k = weight.shape
    padded = F.pad(weight, (0, k % 2, 0, -n % BLOCK))
    return padded.view(-1, BLOCK, padded.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


class CpuBf16WeightKernel(DenseLinearKernel):
    """y = x W^T + b for a bfloat16 W [N, K], packed once; any number of rows, float32 sums. Make
    only where bf16_weight_kernel_fits()."""

    frees_original = True
    graph_rows = GRAPH_ROWS

    def __init__(self):
        self._gemm = torch.ops.tengyun.bf16_weight_gemm.default  # resolved once

    def prepare(self, weight: torch.Tensor) -> PackedBf16Weight | torch.Tensor:
        """The packed copy; the weight itself (F.linear multiplies it) where N is not a multiple of 16
        or K is odd, so that no layer holds padding (`tengyun plan` counts N x K x 2 bytes): small
        layers such as a MoE router of 8 experts."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError(f"CpuBf16WeightKernel multiplies 2-D bfloat16 weights; got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        if weight.shape[0] % BLOCK or weight.shape[1] % 2:
            return weight
        return PackedBf16Weight(pack_weight(weight), weight.shape[0], weight.shape[1])

    def apply(self, x: torch.Tensor, weight: PackedBf16Weight | torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] (bfloat16; float32 on packed weights) -> [..., N] in x's dtype."""
        if isinstance(weight, torch.Tensor):  # left unpacked by prepare
            return F.linear(x, weight.to(x.dtype), bias)
        rows = x.reshape(-1, x.shape[-1])
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        return self._gemm(rows, weight.packed, weight.out_features, bias).view(*x.shape[:-1], weight.out_features)

    def row_reader(self, prepared: PackedBf16Weight, original: torch.Tensor) -> RowReader | None:
        """ids [T] -> rows [T, K] read from the packed copy, once every row read back equals
        ``original`` [N, K] bit for bit; None where one differs."""
        if not isinstance(prepared, PackedBf16Weight) or original.dtype != torch.bfloat16 \
                or tuple(original.shape) != (prepared.out_features, prepared.in_features):
            return None
        return checked_packed_row_reader(prepared.packed.data_ptr(), original, prepared.packed.shape[1] * 2, BLOCK,
                                         "The packed bfloat16")
