"""The compiled weight-only quantised linear (tengyun/csrc/quant_gemv.cpp) against torch's int4 CPU
matmul (_weight_int4pack_mm_for_cpu, what 4-bit layers ran before) at SmolLM2-135M's layer shapes,
4 bits, group 32, bfloat16 activations: per row count, the kernel, the layout dequantized once per
call + one dense matmul, and torch's. GGUF Q8_0 (--q8): the kernel's 8-bit path against torch's
two int4 planes. Milliseconds per call: the median of ROUNDS rounds of CALLS calls, the columns
interleaved inside each round.

    python benchmarks/quant_gemv_kernels.py [--q8] [--rows 1,2,4] [--threads N]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from tengyun.layers.attention import cpu_kernels
from tengyun.platforms import cpu_quant_layout as layout

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate_up, down
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ROUNDS, CALLS = 7, 10
GROUP = 32


def _median_ms(fns: dict, calls: int) -> dict:
    times = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            fn()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _int4_runs(out: int, in_: int, x: torch.Tensor) -> dict:
    n = torch.randint(0, 16, (out, in_), dtype=torch.uint8)
    scale = (torch.rand(out, in_ // GROUP) * 0.01).to(torch.bfloat16)
    zero = torch.randint(0, 16, (out, in_ // GROUP), dtype=torch.uint8)
    prepared = layout.pack(n, 4, scale, zero)
    int4pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(n.to(torch.int32), 1)
    zero_term = -(zero.float() - 8) * scale.float()  # torch's w = (n - 8) * s + zero_term
    scales_and_zeros = torch.stack([scale.t(), zero_term.t().bfloat16()], dim=-1).contiguous()
    group = layout._group(prepared)
    return {
        "kernel": lambda: torch.ops.tengyun.quant_linear(x, prepared["qpacked"], 4, group, prepared["qscales"],
                                                         prepared["qzeros"], None, 0.0, out, None),
        "dequant+mm": lambda: torch.mm(x, layout.dequantized_t(prepared, 4, 0, "bfloat16")),
        "torch int4": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4pack, GROUP, scales_and_zeros),
    }


def _q8_runs(out: int, in_: int, x: torch.Tensor) -> dict:
    q = torch.randint(-128, 128, (out, in_), dtype=torch.int32)
    scale = (torch.rand(out, in_ // GROUP) * 0.01).half()
    prepared = layout.pack(q, 8, scale)
    planes = []
    d = scale.float()
    for nibbles, s, z in (((q >> 4) + 8, 16 * d, 0 * d), (q & 15, d, 8 * d)):  # cpu_gguf.py int4_planes
        planes.append((torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1),
                       torch.stack([s.t(), z.t()], dim=-1).bfloat16().contiguous()))

    def two_planes():
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, planes[0][0], GROUP, planes[0][1])
        y += torch.ops.aten._weight_int4pack_mm_for_cpu(x, planes[1][0], GROUP, planes[1][1])
        return y

    return {
        "kernel": lambda: torch.ops.tengyun.quant_linear(x, prepared["qpacked"], 8, GROUP, prepared["qscales"],
                                                         None, None, 0.0, out, None),
        "torch int4 x2": two_planes,
    }


def main(argv: list[str]) -> None:
    assert cpu_kernels.load_error() is None, cpu_kernels.load_error()
    q8 = "--q8" in argv
    if "--threads" in argv:
        torch.set_num_threads(int(argv[argv.index("--threads") + 1]))
    rows_list = [int(r) for r in argv[argv.index("--rows") + 1].split(",")] if "--rows" in argv else None
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {'Q8_0' if q8 else 'int4 group 32'}")
    header = None
    for out, in_ in SHAPES:
        for rows in rows_list or (ROWS if not q8 else ROWS[:5]):
            x = torch.randn(rows, in_).bfloat16()
            runs = (_q8_runs if q8 else _int4_runs)(out, in_, x)
            times = _median_ms(runs, CALLS if rows <= 64 else 3)
            if header is None:
                header = list(times)
                print("| out x in | rows | " + " | ".join(header) + " |\n|---|---|" + "---|" * len(header))
            print(f"| {out} x {in_} | {rows} | " + " | ".join(f"{times[c]:.4f}" for c in header) + " |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
