"""Is CPU decode attention memory-bound? Times Tengyun's paged decode attention over 30 layers with
their own KV caches (as in a real step, so the context comes from DRAM, not cache): the compiled
kernel that reads blocks in place (cpu_paged, platforms/cpu/kernels/attention.py; when built), the
PyTorch path (gather + SDPA in float32, gather + two batched matmuls in bfloat16,
layers/attention/torch_sdpa.py), the same gather followed by SDPA (the path before), and only
reading K/V.

SmolLM2-135M's shapes by default: 64 sequences of ~150 tokens, 9 query / 3 KV heads of 64.

    python benchmarks/decode_attention_bandwidth.py [--threads 2] [--dtype bfloat16]
    # one build against another (a .so under ~/.cache/tengyun/torch_extensions/), kernel only; with
    # --layers 1 --seqs 16 --repeat 120 the K/V stay in cache: the kernel's arithmetic alone
    python benchmarks/decode_attention_bandwidth.py --kernel-only --library PATH/tengyun_cpu_kernels.so
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tengyun.platforms.cpu import native as cpu_kernels
from tengyun.layers.attention.metadata import AttentionMetadata
from tengyun.layers.attention.torch_sdpa import TorchSDPABackend


def best_ms(fn, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - start) * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeat", type=int, default=1, help="calls per layer in a step")
    parser.add_argument("--kernel-only", action="store_true", help="time the compiled kernel alone")
    parser.add_argument("--library", default=None, help="load this kernel build instead of the checkout's")
    args = parser.parse_args()
    if args.library:
        torch.ops.load_library(args.library)
        cpu_kernels._loaded = args.library  # load_error() then reports it loaded
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    q_heads, kv_heads, dim, block_size = 9, 3, 64, 16
    blocks_per_seq = -(-args.context // block_size)
    num_blocks = args.seqs * blocks_per_seq
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype),
               torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)) for _ in range(args.layers)]
    tables = torch.arange(num_blocks).view(args.seqs, blocks_per_seq)
    lens = torch.full((args.seqs,), args.context)
    q = torch.randn(args.seqs, q_heads, dim, generator=gen).to(dtype)
    backend = TorchSDPABackend()
    meta = AttentionMetadata(slot_mapping=torch.zeros(args.seqs, dtype=torch.int64), num_decode_tokens=args.seqs,
                             decode_block_tables=tables, decode_seq_lens=lens)
    mask = (torch.arange(args.context)[None, :] < lens[:, None])[:, None, None, :]

    def sdpa(k, v):  # the decode path before: the same gather, then SDPA with a boolean mask
        keys = backend._gather("k", k, tables, args.context)
        values = backend._gather("v", v, tables, args.context)
        return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=dim ** -0.5,
                                              enable_gqa=True)

    kernel_error = cpu_kernels.load_error()
    if kernel_error:
        print(f"no cpu_paged row: {kernel_error}")
    out = torch.empty_like(q)

    def kernel(k, v):
        cpu_kernels.paged_decode_attention(out, q, k, v, tables, lens, dim ** -0.5)

    rows = []
    for _ in range(2):  # interleaved, best of each
        if not kernel_error:
            rows.append((f"cpu_paged kernel, in place ({cpu_kernels.isa()})",
                         best_ms(lambda: [kernel(k, v) for k, v in caches * args.repeat])))
        if args.kernel_only:
            continue
        rows.append(("torch_sdpa backend (gather, then SDPA / matmuls)",
                     best_ms(lambda: [backend._decode(q, k, v, meta, dim ** -0.5) for k, v in caches * args.repeat])))
        rows.append(("gather + SDPA (before)", best_ms(lambda: [sdpa(k, v) for k, v in caches * args.repeat])))
        rows.append(("read K/V only (sum)", best_ms(lambda: [(k.sum(), v.sum()) for k, v in caches * args.repeat])))
    best = {name: min(ms for n, ms in rows if n == name) for name, _ in rows}
    kv_bytes = 2 * args.seqs * args.context * kv_heads * dim * caches[0][0].element_size() * args.layers * args.repeat
    print(f"{args.layers} layers, {args.seqs} x {args.context} tokens, {args.dtype}, {args.threads} threads: "
          f"K/V {kv_bytes / 2**20:.0f} MiB per step")
    print("| what | ms per step | GB/s of K/V |")
    print("|---|---|---|")
    for name, ms in best.items():
        print(f"| {name} | {ms:.1f} | {kv_bytes / ms / 1e6:.1f} |")


if __name__ == "__main__":
    main()
