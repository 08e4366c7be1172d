"""The compiled CPU paged decode attention kernel, this checkout's against a baseline git revision's,
interleaved in one process: microseconds per call (one layer), median over rounds.

The baseline's paged_attention.cpp (+ its headers) is taken from `git show REV:...`, its torch op
namespace renamed to `tengyun_base`, and built once into extensions_root()/tengyun_base_<rev>/.
Each of --layers layers gets its own K/V cache (as in a real step: the context comes from DRAM,
not from cache), each sequence its own shuffled blocks, contexts uniform in [--min-context,
--max-context]. Default shapes: SmolLM2-135M's (64 sequences, 9 query / 3 KV heads of 64) and
Qwen2.5-Coder-0.5B's (16 sequences, 14 / 2 heads of 64), block sizes 16 and 128, float32 and
bfloat16 caches.

    python benchmarks/paged_attention_kernel.py --baseline 3845696 [--threads 2] [--rounds 7]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from tengyun.platforms.cpu import native as cpu_kernels

ROOT = Path(__file__).parents[1]
BASE_FILES = ("paged_attention.cpp", "paged_attention_impl.h", "cpu_isa.h")
SHAPES = {"smollm2": (64, 9, 3, 64), "qwen0.5b": (16, 14, 2, 64)}  # batch, query heads, KV heads, head dim


def build_baseline(rev: str) -> None:
    """Build REV's kernel as torch.ops.tengyun_base (a no-op when built) and load it."""
    from torch.utils import cpp_extension

    commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    directory = cpu_kernels.extensions_root() / f"tengyun_base_{commit}"
    source = Path(tempfile.mkdtemp(prefix="tengyun_base_"))
    for name in BASE_FILES:
        text = subprocess.run(["git", "show", f"{commit}:tengyun/csrc/{name}"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout
        (source / name).write_text(re.sub(r"\btengyun\b", "tengyun_base", text))
    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name="tengyun_base_paged", sources=[str(source / "paged_attention.cpp")],
                       extra_cflags=list(cpu_kernels.CFLAGS), extra_ldflags=list(cpu_kernels.LDFLAGS),
                       extra_include_paths=[str(source)], build_directory=str(directory), is_python_module=False)
    torch.ops.load_library(str(directory / "tengyun_base_paged.so"))


def make_case(batch, q_heads, kv_heads, dim, block_size, dtype, layers, lo, hi, seed=0):
    """-> (q [B, Hq, D], [(k_cache, v_cache)] per layer, block_tables [B, nb], seq_lens [B])."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen)
    per_seq = -(-hi // block_size)
    num_blocks = batch * per_seq
    tables = torch.randperm(num_blocks, generator=gen).view(batch, per_seq)
    caches = [(torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype),
               torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)) for _ in range(layers)]
    q = torch.randn(batch, q_heads, dim, generator=gen).to(dtype)
    return q, caches, tables, lens


def us_per_call(op, q, caches, tables, lens, scale, clock) -> float:
    out = torch.empty_like(q)
    start = clock()
    for k, v in caches:
        op(out, q, k, v, tables, lens, scale)
    return (clock() - start) * 1e6 / len(caches)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", default=None, help="git revision to compare against (omit: this one only)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--min-context", type=int, default=128)
    parser.add_argument("--max-context", type=int, default=256)
    parser.add_argument("--shapes", default="smollm2,qwen0.5b")
    parser.add_argument("--block-sizes", default="16,128")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                        help="cpu: this process's CPU time (robust to other processes on a busy machine; "
                        "meaningful with --threads 1, where OpenMP threads do not spin)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    assert cpu_kernels.load_error() is None, cpu_kernels.load_error()
    ops = {"new": torch.ops.tengyun.paged_decode_attention}
    if args.baseline:
        build_baseline(args.baseline)
        ops = {"old": torch.ops.tengyun_base.paged_decode_attention, **ops}
    print(f"{args.threads} threads, {args.layers} layers, contexts {args.min_context}..{args.max_context}, "
          f"median of {args.rounds} rounds, {args.clock} us per call ({cpu_kernels.isa()})")
    print("| shape | block | dtype | " + " | ".join(ops) + (" | speed-up |" if len(ops) > 1 else " |"))
    print("|---|---|---|" + "---|" * (len(ops) + (len(ops) > 1)))
    for shape in args.shapes.split(","):
        batch, q_heads, kv_heads, dim = SHAPES[shape]
        for block_size in map(int, args.block_sizes.split(",")):
            for dtype in args.dtypes.split(","):
                q, caches, tables, lens = make_case(batch, q_heads, kv_heads, dim, block_size, getattr(torch, dtype),
                                                    args.layers, args.min_context, args.max_context)
                times = {name: [] for name in ops}
                for _ in range(args.rounds):  # interleaved
                    for name, op in ops.items():
                        times[name].append(us_per_call(op, q, caches, tables, lens, dim ** -0.5, clock))
                med = {name: statistics.median(ts) for name, ts in times.items()}
                cells = " | ".join(f"{m:.0f}" for m in med.values())
                ratio = f" | {med['old'] / med['new']:.2f}x |" if len(ops) > 1 else " |"
                print(f"| {shape} B={batch} {q_heads}/{kv_heads}x{dim} | {block_size} | {dtype} | {cells}{ratio}")


if __name__ == "__main__":
    main()
