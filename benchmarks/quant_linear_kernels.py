"""Quantised linear kernels on CPU against the dense ones, at SmolLM2-135M's shapes: float32 and
bfloat16 oneDNN (prepacked), W8A8 (per-token int8 activations + torch._int_mm), W4A16 group 64
through torch's int4 matmul with bfloat16 and with float32 activations, and the dequantizing
reference (what float32 W4A16 runs). Milliseconds per call, best of 3 rounds of 20.

``--packed``: W8A8 from 1 row (decode) to 2048 (prefill), the compiled per-token quantisation +
torch._int_mm + compiled rescale (+ bias) on the int8 [out, in] weights against the packed kernel
(tengyun/csrc/int8_gemv.cpp) on the same weights repacked, for a whole pass of a model's layer
projections, each layer its own weights (streamed from memory, not cache: SmolLM2-135M's 30 x 4,
or with ``--shapes qwen2.5-coder`` Qwen2.5-Coder-0.5B's 24 x 4); the two alternate, median of 5
passes (2 past 64 rows).

    python benchmarks/quant_linear_kernels.py
    OMP_NUM_THREADS=2 python benchmarks/quant_linear_kernels.py --packed [--shapes qwen2.5-coder]
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
from tengyun.platforms.cpu.kernels.quant import CpuInt4PackKernel, CpuW8A8Kernel
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
        "W8A8 int_mm": (CpuW8A8Kernel(w8a8_scheme(), pack=False), {"weight": q8, "weight_scale": s8.reshape(-1, 1)},
                        torch.float32),
        "W4A16 int4 bf16": (int4, int4.prepare({**packed, "weight_scale": s4.bfloat16()}), torch.bfloat16),
        "W4A16 int4 fp32": (int4, int4.prepare({**packed, "weight_scale": s4}), torch.float32),
        "W4A16 dequant fp32": (ReferenceWNA16Kernel(w4), {**packed, "weight_scale": s4}, torch.float32),
    }


# (out, in) of each layer's projections, and the number of layers
MODEL_SHAPES = {
    "smollm2": ({"qkv 576->960": (960, 576), "o 576->576": (576, 576), "gate_up 576->3072": (3072, 576),
                 "down 1536->576": (576, 1536)}, 30),
    "qwen2.5-coder": ({"qkv 896->1152": (1152, 896), "o 896->896": (896, 896), "gate_up 896->9728": (9728, 896),
                       "down 4864->896": (896, 4864)}, 24),
}


def packed_rows(model: str, dtype: torch.dtype = torch.bfloat16) -> None:
    from tengyun.platforms.cpu.kernels.quant import w8a8_packed_fits

    if not w8a8_packed_fits():
        print("the packed W8A8 kernel does not run here (kernels not built, or no AVX-512 VNNI)")
        return
    shapes, layers = MODEL_SHAPES[model]
    old = CpuW8A8Kernel(w8a8_scheme(), compiled=True, pack=False)
    new = CpuW8A8Kernel(w8a8_scheme(), compiled=True)
    torch.manual_seed(0)
    plain = [[_w8a8_weight(n, k, dtype) for n, k in shapes.values()] for _ in range(layers)]
    packed = [[new.prepare(w) for w in layer] for layer in plain]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype} activations, {model}: "
          f"{layers} x {len(shapes)} projections, each layer its own weights; ms per pass, median (best)")
    print("| rows | compiled quantise + _int_mm + rescale | packed kernel | speed-up of medians |")
    print("|---|---|---|---|")
    for rows in (1, 4, 8, 16, 24, 32, 48, 64, 256, 2048):
        xs = [(torch.randn(rows, k).to(dtype), torch.randn(n).to(dtype)) for n, k in shapes.values()]
        times: list[list[float]] = [[], []]
        for _ in range(5 if rows <= 64 else 2):
            for i, (kernel, weights) in enumerate(((old, plain), (new, packed))):
                times[i].append(_model_pass_s(kernel, weights, xs) * 1e3)
        medians = [statistics.median(t) for t in times]
        print(f"| {rows} | {medians[0]:.1f} ({min(times[0]):.1f}) | {medians[1]:.1f} ({min(times[1]):.1f}) | "
              f"{medians[0] / medians[1]:.2f}x |")


def _model_pass_s(kernel, weights: list, xs: list) -> float:
    start = time.perf_counter()
    for layer in weights:
        for prepared, (x, bias) in zip(layer, xs):
            kernel.apply(x, prepared, bias)
    return time.perf_counter() - start


def _w8a8_weight(out_features: int, in_features: int, dtype: torch.dtype) -> dict:
    q, scale = quantize_symmetric(torch.randn(out_features, in_features), 8, None)
    return {"weight": q, "weight_scale": scale.reshape(-1, 1).to(dtype)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--packed", action="store_true", help="W8A8 at 1-2048 rows: torch._int_mm vs the packed kernel")
    parser.add_argument("--shapes", choices=sorted(MODEL_SHAPES), default="smollm2")
    args = parser.parse_args()
    if args.packed:
        return packed_rows(args.shapes)
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
