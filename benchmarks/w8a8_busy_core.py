"""The packed W8A8 kernel (tengyun/csrc/int8_gemv.cpp) with its threads bound as the engine binds
them (platforms/cpu/runtime/thread_binding.py: thread i on CPU i), on a quiet machine and with the
last CPU busy (`taskset -c CPU python -c "while 1: pass"`), the two taking turns pass by pass in one
process. A pass is Qwen2.5-Coder-0.5B's 4 projections x --layers layers, each layer its own random
int8 weights, bfloat16 activations; ms a pass, median of --rounds.

It times the kernels this checkout builds. To compare two commits' kernels, run it from a worktree
of each in turn (their libraries live side by side under the cache, keyed by their sources):

    git worktree add /tmp/before f8155ff~1 && ln -s $PWD/.venv /tmp/before/.venv
    for i in 1 2 3; do (cd /tmp/before && OMP_NUM_THREADS=2 .venv/bin/python benchmarks/w8a8_busy_core.py)
                       OMP_NUM_THREADS=2 .venv/bin/python benchmarks/w8a8_busy_core.py; done
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time

import torch

from tengyun.platforms.cpu import native
from tengyun.platforms.cpu.kernels.quant import CpuW8A8Kernel, w8a8_packed_fits
from tengyun.platforms.cpu.runtime import allocator
from tengyun.platforms.cpu.runtime.thread_binding import ThreadBinding
from tengyun.quantization.compressed_tensors import w8a8_scheme

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from linear_kernels import _alternated  # noqa: E402
from quant_linear_kernels import MODEL_SHAPES, _model_pass_s, _w8a8_weight  # noqa: E402


class Spinner:
    """`python -c "while 1: pass"` on one CPU while running."""

    def __init__(self, cpu: int):
        self.cpu, self.proc = cpu, None

    def set(self, busy: bool) -> None:
        if busy and self.proc is None:
            self.proc = subprocess.Popen(["taskset", "-c", str(self.cpu), sys.executable, "-c", "while 1: pass"])
            time.sleep(0.3)  # its interpreter's start-up is over before a pass is timed
        elif not busy and self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _one_pass(spinner: Spinner, kernel, layers: list, xs: list, busy: bool) -> float:
    """The spinner on (busy) or off, then the median ms of 3 passes."""
    spinner.set(busy)
    return statistics.median(_model_pass_s(kernel, layers, xs) for _ in range(3)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if native.load_error() is not None or not w8a8_packed_fits():
        raise SystemExit("the packed W8A8 kernel does not run here (kernels not built, or no AVX-512 VNNI)")
    allocator.keep_freed_buffers()
    allocator.no_new_mmaps()  # as the engine after loading: no fresh mmaps faulted in every call
    threads = torch.get_num_threads()
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    shapes, _ = MODEL_SHAPES["qwen2.5-coder"]
    kernel = CpuW8A8Kernel(w8a8_scheme(), compiled=True)
    torch.manual_seed(0)
    layers = [[kernel.prepare(_w8a8_weight(n, k, torch.bfloat16)) for n, k in shapes.values()]
              for _ in range(args.layers)]
    spinner = Spinner(cpus[-1])
    print(f"{threads} threads bound to CPUs {cpus}; busy: a spinner on CPU {cpus[-1]}; "
          f"Qwen2.5-Coder's projections x {args.layers} layers, ms a pass, median of {args.rounds}")
    print("| rows | quiet | busy |\n|---|---|---|")
    try:
        with ThreadBinding(cpus).step(threads):
            for rows in (int(r) for r in args.rows.split(",")):
                xs = [(torch.randn(rows, k).bfloat16(), torch.randn(n).bfloat16()) for n, k in shapes.values()]

                run = functools.partial(_one_pass, spinner, kernel, layers, xs)
                ms = _alternated(run, (False, True), args.rounds, warmup_rounds=1)
                print(f"| {rows} | {ms[False]:.1f} | {ms[True]:.1f} |")
    finally:
        spinner.set(False)


if __name__ == "__main__":
    main()
