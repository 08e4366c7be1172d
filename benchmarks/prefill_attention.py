"""Prefill attention of fresh prompts on CPU: torch_sdpa (torch's SDPA over the batch of prompts)
against cpu_paged's compiled paged kernel (every query token a decode row over the cache; forced
here for every case) and, in bfloat16 where it runs (AVX512_BF16, no AMX), the tiled prefill kernel
(csrc/prefill_attention_bf16.cpp), one layer's call as the engine makes it: the cases that set
cpu_paged.MAX_PAGED_SEQ_LEN and where the tiled kernel takes over.

    OMP_NUM_THREADS=2 python benchmarks/prefill_attention.py [--heads 9 --kv-heads 3]

Default shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head dim 64), 16-token blocks (the
CPU default). Median of --repeats calls, the two backends alternating, K/V already in the cache
(write_kv runs before attention in a step). "cpu_paged picks" says which path the backend takes.
The machine may be shared: compare the columns of one run, not runs with each other.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tengyun.platforms.cpu import native as cpu_kernels
from tengyun.platforms.cpu.kernels import attention as cpu_paged
from tengyun.layers.attention.metadata import AttentionMetadata, PrefillChunk
from tengyun.platforms.attention_backends import get_attention_backend

CASES = [(16, 128), (8, 256), (4, 512), (4, 128), (1, 128), (1, 512), (1, 1024), (1, 2048)]  # (prompts, tokens each)


def prefill_case(count: int, length: int, heads: int, kv_heads: int, dtype: torch.dtype, block_size: int):
    """(q, k, v, k_cache, v_cache, chunks): count fresh prompts side by side, each in its own
    shuffled blocks holding its K/V."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-length // block_size)
    tokens, dim = count * length, 64
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    k_cache = torch.zeros(count * per_seq, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.randperm(count * per_seq, generator=gen).view(count, per_seq)
    positions = torch.arange(length)
    for b in range(count):
        slots = tables[b, positions // block_size] * block_size + positions % block_size
        k_cache.view(-1, kv_heads, dim)[slots] = k[b * length:(b + 1) * length]
        v_cache.view(-1, kv_heads, dim)[slots] = v[b * length:(b + 1) * length]
    chunks = [PrefillChunk(b * length, length, 0, tables[b]) for b in range(count)]
    return q, k, v, k_cache, v_cache, chunks


def time_case(args, count: int, length: int, dtype: torch.dtype) -> str:
    q, k, v, k_cache, v_cache, chunks = prefill_case(count, length, args.heads, args.kv_heads, dtype, args.block_size)
    tiled_runs = cpu_paged.tiled_prefill_runs(dtype, dtype, q.shape[-1])
    picks = ("tiled kernel" if cpu_paged.tiled_prefill(chunks[0], tiled_runs) else
             "paged kernel" if cpu_paged.in_kernel(chunks[0], dtype) else "SDPA")
    paths = {"torch_sdpa": ("torch_sdpa", 1 << 30), "paged": ("cpu_paged", 0)}  # (backend, tiled head dims)
    if tiled_runs:
        paths["tiled"] = ("cpu_paged", cpu_paged.TILED_MAX_HEAD_DIM)
    backends = {name: get_attention_backend(backend) for name, (backend, _) in paths.items()}
    times: dict[str, list[float]] = {name: [] for name in paths}
    outputs = {}
    names = ("MAX_PAGED_SEQ_LEN", "FLOAT32_MAX_PAGED_SEQ_LEN", "AMX_BF16_MAX_PAGED_SEQ_LEN", "TILED_MAX_HEAD_DIM")
    default = [getattr(cpu_paged, name) for name in names]
    for name in names[:3]:
        setattr(cpu_paged, name, 1 << 30)  # every chunk the tiled kernel leaves in the paged kernel
    # per-step state built once per path (as a step's layers share it), the path's routing fixed at its first call
    metas = {name: AttentionMetadata(slot_mapping=torch.zeros(q.shape[0], dtype=torch.int64), num_decode_tokens=0,
                                     prefills=chunks) for name in paths}
    try:
        for _ in range(args.repeats):
            for name, (_, head_dims) in paths.items():
                cpu_paged.TILED_MAX_HEAD_DIM = head_dims
                start = time.perf_counter()
                outputs[name] = backends[name].forward(q, k, v, k_cache, v_cache, metas[name], 64 ** -0.5)
                times[name].append(time.perf_counter() - start)
    finally:
        for name, value in zip(names, default):
            setattr(cpu_paged, name, value)
    ms = {name: statistics.median(times[name]) * 1e3 for name in paths}
    diff = max((outputs[name].float() - outputs["torch_sdpa"].float()).abs().max().item() for name in outputs)
    tiled = f"{ms['tiled']:.2f} | {ms['paged'] / ms['tiled']:.2f}x" if "tiled" in ms else "- | -"
    return (f"| {str(dtype)[6:]} | {count} x {length} | {ms['torch_sdpa']:.2f} | {ms['paged']:.2f} | "
            f"{ms['torch_sdpa'] / ms['paged']:.2f}x | {tiled} | {picks} | {diff:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    error = cpu_kernels.load()
    if error is not None:
        raise SystemExit(f"the CPU kernels are not loaded: {error}")
    print(f"{torch.get_num_threads()} threads, {args.heads} / {args.kv_heads} heads of 64, "
          f"{args.block_size}-token blocks")
    print("| dtype | prompts x tokens | torch_sdpa ms | paged kernel ms | paged / SDPA speed-up | tiled kernel ms | "
          "tiled / paged speed-up | cpu_paged picks | max abs diff from SDPA |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for count, length in CASES:
            print(time_case(args, count, length, dtype), flush=True)


if __name__ == "__main__":
    main()
