"""Linear-layer kernels on CPU: F.linear vs oneDNN (plain and with the weight prepacked),
at SmolLM2-135M's shapes. Prints milliseconds per call (best of 3 rounds of 30 calls).

    python benchmarks/linear_kernels.py
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from tengyun.layers.linear_kernel import OneDNNPackedLinearKernel

SHAPES = {"gate_up 576->3072": (3072, 576), "down 1536->576": (576, 1536), "lm_head 576->49152": (49152, 576)}


def _ms(fn, calls: int = 30) -> float:
    best = float("inf")
    for _ in range(3):
        fn()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
    return best


def main() -> None:
    torch.manual_seed(0)
    kernel = OneDNNPackedLinearKernel()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| shape | rows | F.linear ms | oneDNN packed ms | speed-up |")
    print("|---|---|---|---|---|")
    for name, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features)
        packed = kernel.prepare(weight)
        for rows in (1, 8, 64, 512):
            x = torch.randn(rows, in_features)
            dense = _ms(functools.partial(F.linear, x, weight))
            onednn = _ms(functools.partial(kernel.apply, x, packed, None))
            print(f"| {name} | {rows} | {dense:.3f} | {onednn:.3f} | {dense / onednn:.2f}x |")


if __name__ == "__main__":
    main()
