"""Quantised linear kernels on CPU against the dense ones, at SmolLM2-135M's shapes: float32 and
bfloat16 oneDNN (prepacked), W8A8 (per-token int8 activations + torch._int_mm), W4A16 group 64
through torch's int4 matmul with bfloat16 and with float32 activations, and the dequantizing
reference (what float32 W4A16 runs). Milliseconds per call, best of 3 rounds of 20.

``--gemv``: W8A8 at 1-24 rows, the compiled per-token quantisation + torch._int_mm + compiled rescale
(+ bias) against the one-call VNNI kernel (tengyun/csrc/int8_gemv.cpp) on the same int8 weights,
per projection shape through 30 separate weights (as 30 layers: streamed from memory, not cache)
and for a whole pass of SmolLM2-135M's 30 x 4 layer projections; old and new alternate, median of
15 passes (the kernel run at every row count, past MAX_GEMV_ROWS too); the row counts where the
kernel wins set cpu_quant.MAX_GEMV_ROWS.

    python benchmarks/quant_linear_kernels.py
    OMP_NUM_THREADS=2 python benchmarks/quant_linear_kernels.py --gemv
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch

from tengyun.layers.linear_kernel import OneDNNPackedLinearKernel
from tengyun.layers.quant_kernels import ReferenceWNA16Kernel
from tengyun.platforms.cpu_quant import CpuInt4PackKernel, CpuW8A8Kernel
from tengyun.quantization.compressed_tensors import w8a8_scheme, weight_only_scheme
from tengyun.quantization.packing import pack_int32, quantize_symmetric

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from linear_kernels import _ms  # noqa: E402 - the same best-of-3 timer

SHAPES = {"qkv 576->960": (960, 576), "gate_up 576->3072": (3072, 576), "down 1536->576": (576, 1536)}
COLUMNS = ("fp32 oneDNN", "bf16 oneDNN", "W8A8 int_mm", "W4A16 int4 bf16", "W4A16 int4 fp32", "W4A16 dequant fp32")


def _kernels(weight: torch.Tensor) -> dict:
    """column -> (kernel, prepared weight, activation dtype)"""
    onednn = OneDNNPackedLinearKernel()
    q8, s8 = quantize_symmetric(weight, 8, None)
    q4, s4 = quantize_symmetric(weight, 4, 64)
    w4 = weight_only_scheme(4, 64, True)
    packed = {"weight_packed": pack_int32(q4, 4)}
    int4 = CpuInt4PackKernel(w4)
    return {
        "fp32 oneDNN": (onednn, onednn.prepare(weight), torch.float32),
        "bf16 oneDNN": (onednn, onednn.prepare(weight.bfloat16()), torch.bfloat16),
        "W8A8 int_mm": (CpuW8A8Kernel(w8a8_scheme()), {"weight": q8, "weight_scale": s8.reshape(-1, 1)}, torch.float32),
        "W4A16 int4 bf16": (int4, int4.prepare({**packed, "weight_scale": s4.bfloat16()}), torch.bfloat16),
        "W4A16 int4 fp32": (int4, int4.prepare({**packed, "weight_scale": s4}), torch.float32),
        "W4A16 dequant fp32": (ReferenceWNA16Kernel(w4), {**packed, "weight_scale": s4}, torch.float32),
    }


GEMV_SHAPES = {"qkv 576->960": (960, 576), "o 576->576": (576, 576), "gate_up 576->3072": (3072, 576),
               "down 1536->576": (576, 1536)}
LAYERS = 30


def gemv_rows(dtype: torch.dtype = torch.bfloat16) -> None:
    from tengyun.layers.attention import cpu_kernels
    from tengyun.platforms.cpu_quant import w8a8_gemv_fits

    if cpu_kernels.load_error() is not None or not w8a8_gemv_fits():
        print("the W8A8 small-batch kernel does not run here (kernels not built, or no AVX-512 VNNI)")
        return
    old = CpuW8A8Kernel(w8a8_scheme(), compiled=True, max_gemv_rows=0)
    new = CpuW8A8Kernel(w8a8_scheme(), compiled=True, max_gemv_rows=64)
    torch.manual_seed(0)
    weights = {name: [_w8a8_weight(n, k, dtype) for _ in range(LAYERS)] for name, (n, k) in GEMV_SHAPES.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype} activations; "
          f"{LAYERS} weights per shape; us per call, median of 15 (best of 15)")
    print("| projection | rows | compiled quantise + _int_mm + rescale | int8_gemv | speed-up of medians (of bests) |")
    print("|---|---|---|---|---|")
    totals: dict[int, list[float]] = {}
    for rows in (1, 2, 4, 8, 16, 24):
        for name, (n, k) in GEMV_SHAPES.items():
            x, bias = torch.randn(rows, k).to(dtype), torch.randn(n).to(dtype)
            times: list[list[float]] = [[], []]
            for _ in range(15):
                for i, kernel in enumerate((old, new)):
                    times[i].append(_pass_s(kernel, weights[name], x, bias) / LAYERS * 1e6)
            stats = [statistics.median(times[0]), statistics.median(times[1]), min(times[0]), min(times[1])]
            totals[rows] = [a + b for a, b in zip(totals.get(rows, [0.0] * 4), stats)]
            print(_gemv_row(name, rows, stats, 1.0))
    for rows, stats in totals.items():
        print(_gemv_row("30 x 4 projections (ms)", rows, stats, LAYERS / 1e3))


def _gemv_row(name: str, rows: int, stats: list[float], unit: float) -> str:
    """stats: medians old, new, bests old, new (us) -> a table row in unit x us."""
    old, new, old_best, new_best = (v * unit for v in stats)
    return (f"| {name} | {rows} | {old:.1f} ({old_best:.1f}) | {new:.1f} ({new_best:.1f}) | "
            f"{old / new:.2f}x ({old_best / new_best:.2f}x) |")


def _w8a8_weight(out_features: int, in_features: int, dtype: torch.dtype) -> dict:
    q, scale = quantize_symmetric(torch.randn(out_features, in_features), 8, None)
    return {"weight": q, "weight_scale": scale.reshape(-1, 1).to(dtype)}


def _pass_s(kernel, weights: list, x: torch.Tensor, bias: torch.Tensor) -> float:
    start = time.perf_counter()
    for prepared in weights:
        kernel.apply(x, prepared, bias)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gemv", action="store_true", help="W8A8 at 1-24 rows: torch._int_mm vs int8_gemv")
    if parser.parse_args().gemv:
        return gemv_rows()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| shape | rows | " + " | ".join(COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for name, (out_features, in_features) in SHAPES.items():
        kernels = _kernels(torch.randn(out_features, in_features))
        for rows in (1, 32):
            x = torch.randn(rows, in_features)
            times = [_ms(functools.partial(kernel.apply, x.to(dtype), prepared, None), calls=20)
                     for kernel, prepared, dtype in (kernels[c] for c in COLUMNS)]
            print(f"| {name} | {rows} | " + " | ".join(f"{t:.3f}" for t in times) + " |")


if __name__ == "__main__":
    main()
