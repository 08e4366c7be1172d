"""GPTQ act order (desc_act) on CPU in bfloat16, at SmolLM2-135M's shapes, W4A16 group 64: the
inputs sorted by group once and the activations gathered per call, then torch's int4 matmul
(what Tengyun runs) against the same layer without act order (the gather's cost) and against
dequantizing through g_idx per call (the reference, what float32 runs). Milliseconds per call,
best of 3 rounds of 20.

    python benchmarks/act_order_kernels.py
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np
import torch

from tengyun.layers.quant_kernels import ReferenceWNA16Kernel
from tengyun.platforms.cpu.kernels.quant import CpuInt4PackKernel
from tengyun.quantization import gptq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "quantization"))
from awq_gptq_layouts import Format, quantize_layer  # noqa: E402
from linear_kernels import _ms  # noqa: E402 - the same best-of-3 timer

SHAPES = {"qkv 576->960": (960, 576), "gate_up 576->3072": (3072, 576), "down 1536->576": (576, 1536)}
COLUMNS = ("int4 + gather (act order)", "int4 (in order)", "dequant via g_idx")


def _layer(desc_act: bool, out: int, in_: int):
    fmt = Format("gptq", group=64, sym=True, desc_act=desc_act)
    scheme = gptq.from_config(fmt.quantization_config()).groups[0].scheme
    stored, _ = quantize_layer(fmt, "m.q_proj", out, in_, np.random.default_rng(0))
    stored = {k.removeprefix("m.q_proj."): v for k, v in stored.items()}
    return scheme, {t.name: stored[t.name].bfloat16() if t.dtype == "act" else stored[t.name]
                    for t in scheme.tensors if t.kept}


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| shape | rows | " + " | ".join(COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for name, (out, in_) in SHAPES.items():
        act_scheme, act_tensors = _layer(True, out, in_)
        in_scheme, in_tensors = _layer(False, out, in_)
        runs = [(CpuInt4PackKernel(act_scheme), act_tensors), (CpuInt4PackKernel(in_scheme), in_tensors),
                (ReferenceWNA16Kernel(act_scheme), act_tensors)]
        prepared = [(kernel, kernel.prepare(dict(tensors))) for kernel, tensors in runs]
        assert "perm" in prepared[0][1] and "int4pack" in prepared[1][1]
        for rows in (1, 32):
            x = torch.randn(rows, in_, dtype=torch.bfloat16)
            times = [_ms(functools.partial(kernel.apply, x, weights, None), calls=20) for kernel, weights in prepared]
            print(f"| {name} | {rows} | " + " | ".join(f"{t:.3f}" for t in times) + " |")


if __name__ == "__main__":
    main()
