"""bfloat16 linear layers on cores without bfloat16 arithmetic (AVX2 + FMA, no AVX512-BF16).

There oneDNN does not pack a bfloat16 weight (its reorder needs AVX512 BW/VL/DQ or AVX-NE-CONVERT)
and F.linear's own bfloat16 GEMM ran at ~19 GFLOP/s on 2 cores of an AMD EPYC without AVX-512,
against ~135 for float32 (2026-12-07, benchmarks/README.md "An AVX2 machine"). The compiled kernel
(tengyun/csrc/bf16_weight_gemm.cpp) keeps the weight as loaded, bfloat16 [N, K], widens it to
float32 in registers and sums in float32: a decode step streams half the bytes float32 would, and
batches of up to MAX_KERNEL_ROWS rows run it. Larger ones (prefill steps) widen the weight to float32
and run F.linear's float32 GEMM, which is faster there than the kernel's register-only widening.

The weight is the loaded tensor itself (no copy), so a tied embedding reads its rows as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tengyun.layers.linear_kernel import DenseLinearKernel

# Decode graphs (cpu/runtime/graphs.py) are captured for decodes of up to this many sequences:
# every batch runs the compiled op, which a trace holds, as with the small-batch kernel's 64.
GRAPH_ROWS = 64
# Up to this many rows run the compiled kernel; more widen the weight and run F.linear in float32.
# `benchmarks/linear_kernels.py --bf16-weights` and a widening variant, 2026-12-07, AMD EPYC without
# AVX-512 (avx2 fma), 2 threads, SmolLM2's 30 x 4 projections: the kernel 15.4 ms at 1 row (oneDNN
# float32 26.7, F.linear bfloat16 17.3), 128.9 at 64 rows against 149.8 widened, even at 128-256
# (256.6 / 252.9, 464.4 / 463.4), behind at 512 (1205.5 against 818.9).
MAX_KERNEL_ROWS = 128
# The widened path converts at most this many weight elements at a time (128 MiB of float32), so a
# large LM head does not need a float32 copy of itself at once.
WIDEN_CHUNK_ELEMENTS = 1 << 25


def bf16_weight_kernel_fits() -> bool:
    """Whether the compiled kernels are loaded and this CPU runs the AVX2 bfloat16-weight kernel."""
    from tengyun.platforms.cpu import native

    return native.load_error() is None and bool(torch.ops.tengyun.bf16_weight_gemm_supported())


class CpuBf16WeightKernel(DenseLinearKernel):
    """y = x W^T + b for bfloat16 W [N, K] as loaded, any number of rows, float32 sums. Make only
    where bf16_weight_kernel_fits()."""

    graph_rows = GRAPH_ROWS

    def __init__(self):
        self._gemm = torch.ops.tengyun.bf16_weight_gemm.default  # resolved once

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        if weight.dtype != torch.bfloat16:
            raise ValueError(f"CpuBf16WeightKernel multiplies bfloat16 weights; got {weight.dtype}")
        return weight.contiguous()

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] (bfloat16 or float32) -> [..., N] in x's dtype."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > MAX_KERNEL_ROWS:
            y = _widened_linear(rows, weight, bias)
        else:
            y = self._gemm(rows if rows.stride(-1) == 1 else rows.contiguous(), weight, bias)
        return y.view(*x.shape[:-1], weight.shape[0])


def _widened_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [M, K] @ weight [N, K]^T (+ bias) in float32, the weight widened WIDEN_CHUNK_ELEMENTS at a
    time; [M, N] in rows' dtype."""
    x32 = rows.float()
    step = max(1, WIDEN_CHUNK_ELEMENTS // weight.shape[1])
    if step >= weight.shape[0]:
        return F.linear(x32, weight.float(), None if bias is None else bias.float()).to(rows.dtype)
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=rows.dtype)
    for n0 in range(0, weight.shape[0], step):
        part = None if bias is None else bias[n0:n0 + step].float()
        out[:, n0:n0 + step] = F.linear(x32, weight[n0:n0 + step].float(), part)
    return out
