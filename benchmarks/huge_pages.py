"""Weights on 4 KiB pages against the same weights on 2 MiB pages, in one process.

Two sets of random bfloat16 weights of a model's decoder linears and LM head, prepared by the CPU
platform's linear kernel (oneDNN's packed layout; the small-batch kernel reads it at a few rows);
only the second set is moved onto huge pages (tengyun/platforms/cpu/runtime/hugepages.py, as the worker
does once the weights are loaded). Each round runs one step's linears on set A, then on set B:
every layer's weight once, as a decode step streams them (the sets are larger than the L3, so
each comes from memory), ROUNDS rounds; medians and minima in milliseconds. Same process, same
inputs, alternated, so the machine's drift falls on both.

    OMP_NUM_THREADS=2 python benchmarks/huge_pages.py [--model smollm2|qwen2.5-coder] [--rows 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tengyun.platforms.cpu import native as cpu_kernels
from tengyun.platforms.cpu.runtime import hugepages as cpu_hugepages
from tengyun.platforms.cpu.kernels.linear import CpuPackedLinearKernel, small_batch_kernel_fits

# (decoder linears (out, in): qkv, o, gate_up, down; layers; LM head)
SHAPES = {"smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, (49152, 576)),
          "qwen2.5-coder": ([(1152, 896), (896, 896), (9728, 896), (896, 4864)], 24, (151936, 896))}
ROUNDS = 40


def weights(kernel, shapes, layers, head):
    """One model's worth of prepared weights: [layers x shapes] and the head."""
    return [[kernel.prepare(torch.randn(o, i).bfloat16()) for o, i in shapes] for _ in range(layers)], \
        kernel.prepare(torch.randn(*head).bfloat16())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--rows", type=int, default=1, help="activation rows (1: batch-1 decode)")
    args = parser.parse_args()
    cpu_kernels.load()
    if not small_batch_kernel_fits(torch.bfloat16):
        print("note: the small-batch kernel does not run here; oneDNN serves every row count")
    shapes, layers, head = SHAPES[args.model]
    kernel = CpuPackedLinearKernel(torch.bfloat16)
    small, huge = weights(kernel, shapes, layers, head), weights(kernel, shapes, layers, head)
    held = [t for layer in huge[0] for w in layer for t in w.tensors()] + huge[1].tensors()
    started = time.perf_counter()
    moved = cpu_hugepages.collapse(cpu_hugepages.weight_ranges(held))
    print(f"{args.model}, {args.rows} row(s), {torch.get_num_threads()} threads, THP {cpu_hugepages.thp_mode()}: "
          f"{moved / 2**20:.0f} MiB of set B moved onto 2 MiB pages in {time.perf_counter() - started:.2f} s")
    inputs = {i: torch.randn(args.rows, i).bfloat16() for _, i in [*shapes, head]}

    def step(model) -> float:
        start = time.perf_counter()
        for layer in model[0]:
            for (_, in_), w in zip(shapes, layer):
                kernel.apply(inputs[in_], w, None)
        kernel.apply(inputs[head[1]], model[1], None)
        return (time.perf_counter() - start) * 1e3

    times = {"4 KiB pages (A)": [], "2 MiB pages (B)": []}
    for _ in range(ROUNDS):
        for model, name in ((small, "4 KiB pages (A)"), (huge, "2 MiB pages (B)")):
            times[name].append(step(model))
    print("| weights on | median ms | min ms |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} |")


if __name__ == "__main__":
    main()
