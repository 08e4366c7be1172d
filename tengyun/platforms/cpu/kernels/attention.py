"""Paged attention on CPU with the compiled decode kernel (tengyun/csrc/paged_attention.cpp).

Decodes read their K/V blocks in place from the paged cache (no gather copy; float32 accumulation,
blocks prefetched ahead), one OpenMP task per (sequence, KV head) that attends all the KV head's
query heads together, 512 tokens at a time: every score, one softmax update, then the values with
each V row read once for all heads. So do prefill chunks with few query tokens (a speculative
verify's last token and drafts) or a short whole sequence (a prompt of up to MAX_PAGED_SEQ_LEN
tokens), every query token with its causal limit, each block read once for all of a sequence's
tokens; token i of a chunk computes exactly what a decode row of its length would. Writing K/V and
the other prefill chunks are torch_sdpa's, unchanged. Picked by ``CpuPlatform.attention_backend``
only when the kernel library loads (platforms/cpu/native.py).
"""

from __future__ import annotations

import torch

from dataclasses import dataclass

from tengyun.platforms.cpu import native as cpu_kernels
from tengyun.layers.attention.metadata import AttentionMetadata, PrefillChunk
from tengyun.layers.attention.torch_sdpa import TorchSDPABackend

# A prefill chunk runs in the paged kernel when it has at most MAX_PAGED_QUERY query tokens, or when
# its whole sequence (cached context + query) is at most MAX_PAGED_SEQ_LEN tokens. Longer ones are
# matmul-bound, where torch's SDPA (flash kernel) over gathered K/V is faster: the kernel does a
# decode row's work per query token and parallelises over sequences x KV heads only. Measured
# (benchmarks/README.md "Prefill attention of short prompts"), SmolLM2's heads, 2 threads, 16-token
# blocks: 16 fresh prompts of 128 tokens, bf16 8.1 ms in SDPA vs 4.9 ms here (fp32 6.7 vs 5.9);
# 8 x 256, bf16 11.5 vs 9.4; one prompt of 512, bf16 4.8 vs 6.0; one of 1024, 14.7 vs 35.9.
MAX_PAGED_QUERY = 16
MAX_PAGED_SEQ_LEN = 256


def in_kernel(chunk: PrefillChunk) -> bool:
    """Whether cpu_paged attends this prefill chunk in the paged kernel (else torch_sdpa's SDPA)."""
    return chunk.query_len <= MAX_PAGED_QUERY or chunk.context_len + chunk.query_len <= MAX_PAGED_SEQ_LEN


@dataclass
class KernelChunks:
    """The step's chunks in_kernel picks as one kernel call, and the rest (torch_sdpa's), split once
    per step (shared by every layer)."""

    rows: slice | torch.Tensor  # their query rows in the flat batch: a slice when contiguous, else [T'] indices
    query_start_loc: torch.Tensor  # [C + 1] int64: chunk c's rows are [qsl[c], qsl[c + 1]) of the T'
    seq_lens: torch.Tensor  # [C] int64: context_len + query_len
    block_tables: torch.Tensor  # [C, max_blocks] int64, padded with block 0 (never read)
    others: list[PrefillChunk]  # the step's chunks in_kernel leaves to SDPA


class CpuPagedBackend(TorchSDPABackend):
    name = "cpu_paged"
    # The kernel reads each row's block table up to its own length: a static decode_max_len
    # (graph replay) costs nothing extra and it never syncs.
    supports_decode_graphs = True

    def __init__(self):
        super().__init__()
        error = cpu_kernels.load_error()
        if error is not None:
            raise RuntimeError(f"attention backend cpu_paged is unavailable: {error}")
        # resolved once: each decode layer calls these
        self._decode_qkv = torch.ops.tengyun.decode_qkv_to_cache.default
        self._paged_decode = torch.ops.tengyun.paged_decode_attention.default

    def decode_from_qkv(self, qkv, positions, cos_table, sin_table, k_cache, v_cache, meta: AttentionMetadata,
                        scale: float, num_heads: int) -> torch.Tensor | None:
        """Two compiled calls for the whole layer's attention at decode (batch 1: ~20 PyTorch ops
        fewer per layer): rotary + cache write + contiguous q (layer_ops.cpp decode_qkv_to_cache),
        then the paged kernel. Only where the cache has qkv's dtype."""
        if qkv.dtype != k_cache.dtype or qkv.stride(-1) != 1:
            return None
        q = self._decode_qkv(qkv, cos_table, sin_table, positions, k_cache, v_cache, meta.slot_mapping, num_heads,
                             k_cache.shape[2])
        out = torch.empty_like(q)
        self._paged_decode(out, q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale)
        return out.view(q.shape[0], -1)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [B, Hq, D] -> [B, Hq, D] over each row's first decode_seq_lens[b] tokens (padding in
        decode_block_tables is never read). q may be a strided view (rotary turns q in place in
        the qkv projection's output); the kernel reads a contiguous copy, B * Hq * D elements."""
        q = q.contiguous()
        out = torch.empty_like(q)
        cpu_kernels.paged_decode_attention(out, q, k_cache, v_cache, meta.decode_block_tables,
                                           meta.decode_seq_lens, scale)
        return out

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """As torch_sdpa's, with the chunks in_kernel picks in the paged kernel (their K/V, like
        everyone's, are in the cache already: write_kv runs first)."""
        kernel = _kernel_chunks(meta)
        if kernel is None:
            return super().forward(q, k, v, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        n = meta.num_decode_tokens
        if n:
            out[:n] = self._decode(q[:n], k_cache, v_cache, meta, scale)
        queries = q[kernel.rows].contiguous()  # [T', Hq, D]
        attended = torch.empty_like(queries)
        cpu_kernels.paged_decode_attention(attended, queries, k_cache, v_cache, kernel.block_tables, kernel.seq_lens,
                                           scale, kernel.query_start_loc)
        out[kernel.rows] = attended
        self._prefill_chunks(out, q, k, v, k_cache, v_cache, kernel.others, meta, scale)
        return out


def _kernel_chunks(meta: AttentionMetadata) -> KernelChunks | None:
    """meta's chunks that in_kernel picks (None: there are none), cached in meta.backend_state for
    the step's other layers."""
    if "kernel_chunks" not in meta.backend_state:
        chunks = [c for c in meta.prefills if in_kernel(c)]
        others = [c for c in meta.prefills if not in_kernel(c)]
        meta.backend_state["kernel_chunks"] = _build_kernel_chunks(chunks, others) if chunks else None
    return meta.backend_state["kernel_chunks"]


def _build_kernel_chunks(chunks: list[PrefillChunk], others: list[PrefillChunk]) -> KernelChunks:
    """Chunks (query_start 40, 3 tokens, 20 cached) (43, 2, 9) -> rows 40..44 (a slice),
    query_start_loc [0, 3, 5], seq_lens [23, 11], their block tables padded to the widest."""
    counts = torch.tensor([c.query_len for c in chunks], dtype=torch.int64)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    tables = torch.zeros(len(chunks), max(c.block_table.numel() for c in chunks), dtype=torch.int64)
    for i, chunk in enumerate(chunks):
        tables[i, :chunk.block_table.numel()] = chunk.block_table
    first = chunks[0].query_start
    if all(c.query_start == first + int(s) for c, s in zip(chunks, starts)):
        rows = slice(first, first + int(starts[-1]))
    else:
        rows = torch.cat([torch.arange(c.query_start, c.query_start + c.query_len) for c in chunks])
    seq_lens = torch.tensor([c.context_len + c.query_len for c in chunks], dtype=torch.int64)
    return KernelChunks(rows, starts, seq_lens, tables, others)
