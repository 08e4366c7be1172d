"""Quantised linear kernels on CPU against the dense ones, at SmolLM2-135M's shapes: float32 and
bfloat16 oneDNN (prepacked), W8A8 (per-token int8 activations + torch._int_mm), W4A16 group 64
through torch's int4 matmul with bfloat16 and with float32 activations, and the dequantizing
reference (what float32 W4A16 runs). Milliseconds per call, best of 3 rounds of 20.

    python benchmarks/quant_linear_kernels.py
"""

from __future__ import annotations

import functools
import os
import sys

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


def main() -> None:
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
