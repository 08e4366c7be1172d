"""The compiled weight-only quantised linear (tengyun/csrc/quant_gemv.cpp) against torch's int4 CPU
matmul (_weight_int4pack_mm_for_cpu, what 4-bit layers ran before) at SmolLM2-135M's layer shapes,
4 bits, group 32, bfloat16 activations: per row count, the kernel, the layout dequantized once per
call + one dense matmul, and torch's. GGUF Q8_0 (--q8): the kernel's 8-bit path against torch's
two int4 planes. Milliseconds per call: the median of ROUNDS rounds of CALLS calls, the columns
interleaved inside each round.

--decode-set: a batch-1 step's layer linears of SmolLM2 (30 layers x the 4 shapes, distinct
weights: ~53 MB at 4 bits, more than the L3, so streamed from memory as in a real step), one row,
through the layer kernels old and new: W4A16 group 64 (CpuInt4PackKernel, compiled layout vs
torch's int4) and GGUF Q4_0 / Q8_0 (CpuGgufCompiledKernel vs CpuGgufInt4PackKernel); medians of
15 alternating rounds, wall and process CPU ms.

    python benchmarks/quant_gemv_kernels.py [--q8] [--rows 1,2,4] [--threads N] [--decode-set]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from tengyun.platforms.cpu import native as cpu_kernels
from tengyun.platforms.cpu.kernels import quant_layout as layout

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
    for nibbles, s, z in (((q >> 4) + 8, 16 * d, 0 * d), (q & 15, d, 8 * d)):  # cpu/kernels/gguf.py int4_planes
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


def _decode_set_kernels(fmt: str) -> tuple:
    """fmt -> (new kernel, old kernel, [(in, new prepared, old prepared)] for 30 layers x SHAPES)."""
    from tengyun.layers.gguf_kernels import q4_0_as_q8_0
    from tengyun.platforms.cpu.kernels.gguf import CpuGgufCompiledKernel, CpuGgufInt4PackKernel
    from tengyun.platforms.cpu.kernels.quant import CpuInt4PackKernel
    from tengyun.quantization.compressed_tensors import weight_only_scheme
    from tengyun.quantization.gguf import scheme_for_type
    from tengyun.quantization.packing import pack_int32, quantize_symmetric

    if fmt == "w4a16":
        scheme = weight_only_scheme(4, 64, True)
        new, old = CpuInt4PackKernel(scheme, compiled=True), CpuInt4PackKernel(scheme, compiled=False)
    else:
        scheme = scheme_for_type(fmt.upper())
        new, old = CpuGgufCompiledKernel(scheme), CpuGgufInt4PackKernel(scheme)
    layers = []
    for _ in range(30):
        for out, in_ in SHAPES:
            if fmt == "w4a16":
                q, s = quantize_symmetric(torch.randn(out, in_), 4, 64)
                tensors = {"weight_packed": pack_int32(q, 4), "weight_scale": s.bfloat16()}
            else:  # random Q4_0 blocks (d ~ 0.01), as Q8_0 where asked (lossless)
                raw = torch.randint(0, 256, (out, in_ // 32, 18), dtype=torch.uint8)
                raw[..., :2] = (torch.rand(out, in_ // 32, 1) * 0.01).half().view(torch.uint8)
                tensors = {"qweight": raw if fmt == "q4_0" else q4_0_as_q8_0(raw)}
            layers.append((in_, new.prepare(dict(tensors)), old.prepare(dict(tensors))))
    return new, old, layers


def decode_set() -> None:
    for fmt in ("w4a16", "q4_0", "q8_0"):
        new, old, layers = _decode_set_kernels(fmt)
        xs = {in_: torch.randn(1, in_).bfloat16() for in_ in {in_ for _, in_ in SHAPES}}
        times: dict[str, list[tuple[float, float]]] = {"new": [], "old": []}
        for _ in range(ROUNDS * 2 + 1):
            for side, kernel, pick in (("new", new, 1), ("old", old, 2)):
                wall, cpu = time.perf_counter(), time.process_time()
                for layer in layers:
                    kernel.apply(xs[layer[0]], layer[pick], None)
                times[side].append(((time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3))
        cells = [f"{statistics.median(w for w, _ in times[s]):.2f} / {statistics.median(c for _, c in times[s]):.2f}"
                 for s in ("new", "old")]
        print(f"| {fmt} | {len(layers)} | " + " | ".join(cells) + " |", flush=True)


def main(argv: list[str]) -> None:
    assert cpu_kernels.load_error() is None, cpu_kernels.load_error()
    q8 = "--q8" in argv
    if "--threads" in argv:
        torch.set_num_threads(int(argv[argv.index("--threads") + 1]))
    if "--decode-set" in argv:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms wall / CPU per step's linears")
        print("| format | linears | new (compiled) | old (torch int4) |\n|---|---|---|---|")
        return decode_set()
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
