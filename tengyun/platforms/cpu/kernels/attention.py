"""Paged attention on CPU with the compiled decode kernel (tengyun/csrc/paged_attention.cpp).

Decodes read their K/V blocks in place from the paged cache (no gather copy; float32 accumulation,
blocks prefetched ahead), one OpenMP task per (sequence, KV head) that attends all the KV head's
query heads together, 512 tokens at a time: every score, one softmax update, then the values with
each V row read once for all heads (from 4 sequences per thread a thread takes whole sequences
and streams the next one's K/V into L2 meanwhile; fewer, a chunk's query tokens go in pieces of
equal work, so one prompt keeps every thread busy). So do prefill chunks with few query tokens (a speculative
verify's last token and drafts) or a short whole sequence (a prompt of up to MAX_PAGED_SEQ_LEN
tokens, FLOAT32_MAX_PAGED_SEQ_LEN in float32; in bfloat16 on cores with AMX only chunks of up to 32
tokens: kernel_limits), every query token with its causal limit, each block read once for all of a
sequence's tokens; token i of a chunk computes exactly what a decode row of its length would.
In bfloat16 on a CPU with AVX512_BF16 and no AMX, prefill chunks of more than MAX_PAGED_QUERY query
tokens, at any length, go to the tiled kernel instead (tengyun/csrc/prefill_attention_bf16.cpp: the
scores and the values as register tiles over keys packed once per task, float32 softmax and sums).
Writing K/V and the other prefill chunks are torch_sdpa's, unchanged. Picked by
``CpuPlatform.attention_backend`` only when the kernel library loads (platforms/cpu/native.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tengyun.host.probe import cpu_flags
from tengyun.platforms.cpu import native as cpu_kernels
from tengyun.layers.attention.metadata import AttentionMetadata, PrefillChunk
from tengyun.layers.attention.torch_sdpa import TorchSDPABackend

# A prefill chunk runs in the paged kernel when it has at most MAX_PAGED_QUERY query tokens, or when
# its whole sequence (cached context + query) is at most MAX_PAGED_SEQ_LEN tokens (float32:
# FLOAT32_MAX_PAGED_SEQ_LEN). Longer ones are matmul-bound, where torch's SDPA (flash kernel) over
# gathered K/V is faster: the kernel does a decode row's work per query token. Since a few chunks
# are attended in pieces of their query tokens (paged_attention_threads.h), one prompt keeps both
# threads busy. Measured 2026-12-06, AMD EPYC VM (avx512_bf16, no AMX), 2 threads, SmolLM2's heads,
# 16-token blocks (benchmarks/prefill_attention.py, SDPA / kernel ms): bfloat16 1 x 512 4.42 / 2.49,
# 1 x 1024 12.57 / 10.05, 2 x 1024 24.99 / 19.87, 1 x 2048 42.92 / 41.78; float32 1 x 512 4.37 /
# 3.51, 1 x 768 7.46 / 7.68, 2 x 1024 23.79 / 24.09.
MAX_PAGED_QUERY = 16
MAX_PAGED_SEQ_LEN = 1024
FLOAT32_MAX_PAGED_SEQ_LEN = 512
# bfloat16 on cores with AMX: torch's SDPA multiplies on AMX tiles and wins from ~48 query tokens
# whatever the context, so only short chunks (a verify, a prompt's last few tokens) stay here.
# 2026-12-05, Intel Xeon VM with amx_bf16, 2 threads, SmolLM2's heads (benchmarks/prefill_attention.py,
# SDPA / kernel ms): fresh 1 x 16 0.04 / 0.02, 1 x 32 0.04 / 0.04, 1 x 64 0.07 / 0.21, 1 x 128
# 0.14 / 0.41, 16 x 128 1.79 / 3.33; 24 tokens after 100 cached 0.12 / 0.10, 48 after 100 0.17 / 0.18,
# 128 after 128 0.28 / 0.70 (float32 does not use the tiles: the limits above stand).
AMX_BF16_MAX_PAGED_QUERY = 32
AMX_BF16_MAX_PAGED_SEQ_LEN = 32
# bfloat16 chunks of more than MAX_PAGED_QUERY query tokens on AVX512_BF16 without AMX: the tiled
# kernel, at every length (2026-12-07, AMD EPYC family 25 VM, 2 threads, fresh prompts, ms tiled /
# paged kernel: SmolLM2's heads 4 x 128 0.44 / 0.73, 16 x 128 1.92 / 3.43, 1 x 512 1.55 / 2.28,
# 1 x 2048 23.8 / 39.8 (SDPA ~45); 512 after 1536 cached 10.4 / 13.8; Qwen2.5-0.5B's 14 / 2 heads
# 4 x 128 0.69 / 1.17; 16 / 8 heads of 128, 1 x 512 6.31 / 8.48; benchmarks/prefill_attention.py).
TILED_MAX_HEAD_DIM = 128


def kernel_limits(dtype: torch.dtype | None) -> tuple[int, int]:
    """(most query tokens, longest whole sequence) of a prefill chunk the paged kernel attends for
    this activation dtype on this CPU (None: the generic limits)."""
    if dtype == torch.bfloat16 and _has_amx_bf16():
        return AMX_BF16_MAX_PAGED_QUERY, AMX_BF16_MAX_PAGED_SEQ_LEN
    if dtype == torch.float32:
        return MAX_PAGED_QUERY, FLOAT32_MAX_PAGED_SEQ_LEN
    return MAX_PAGED_QUERY, MAX_PAGED_SEQ_LEN


@functools.cache
def _has_amx_bf16() -> bool:
    return "amx_bf16" in cpu_flags()


def in_kernel(chunk: PrefillChunk, dtype: torch.dtype | None = None) -> bool:
    """Whether the paged kernel's limits take this prefill chunk (else torch_sdpa's SDPA, or the
    tiled kernel where ``tiled_prefill`` says so, which comes first)."""
    max_query, max_seq_len = kernel_limits(dtype)
    return chunk.query_len <= max_query or chunk.context_len + chunk.query_len <= max_seq_len


def tiled_prefill_runs(dtype: torch.dtype | None, cache_dtype: torch.dtype | None, head_dim: int) -> bool:
    """Whether the tiled bfloat16 prefill kernel runs here: bfloat16 queries and cache, a head dim
    that is a multiple of 32 up to TILED_MAX_HEAD_DIM, a CPU with AVX512_BF16 and without AMX (there
    torch's SDPA multiplies on the tiles), and a library that has the kernel."""
    return (dtype == torch.bfloat16 and cache_dtype == torch.bfloat16 and head_dim % 32 == 0
            and head_dim <= TILED_MAX_HEAD_DIM and _has_avx512_bf16() and not _has_amx_bf16()
            and _tiled_kernel_supported())


@functools.cache
def _has_avx512_bf16() -> bool:  # read once: /proc/cpuinfo is long on a many-core host
    return "avx512_bf16" in cpu_flags()


@functools.cache
def _tiled_kernel_supported() -> bool:
    return cpu_kernels.load_error() is None and hasattr(torch.ops.tengyun, "prefill_attention_bf16") and \
        bool(torch.ops.tengyun.prefill_attention_bf16_supported())


def tiled_prefill(chunk: PrefillChunk, tiled_runs: bool) -> bool:
    """Whether a chunk goes to the tiled kernel where it runs (tiled_prefill_runs): more than
    MAX_PAGED_QUERY query tokens (a verify and its drafts, or a prompt's last few tokens, stay decode
    rows)."""
    return tiled_runs and chunk.query_len > MAX_PAGED_QUERY


@dataclass
class KernelChunks:
    """Chunks one kernel call attends."""

    rows: slice | torch.Tensor  # their query rows in the flat batch: a slice when contiguous, else [T'] indices
    query_start_loc: torch.Tensor  # [C + 1] int64: chunk c's rows are [qsl[c], qsl[c + 1]) of the T'
    seq_lens: torch.Tensor  # [C] int64: context_len + query_len
    block_tables: torch.Tensor  # [C, max_blocks] int64, padded with block 0 (never read)


@dataclass
class StepChunks:
    """A step's prefill chunks by where they are attended, split once per step (shared by every layer)."""

    paged: KernelChunks | None  # the paged (decode) kernel's
    tiled: KernelChunks | None  # the tiled bfloat16 prefill kernel's
    others: list[PrefillChunk]  # torch_sdpa's


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
        self._qkv_to_cache = torch.ops.tengyun.qkv_to_cache_.default
        self._tiled_prefill = torch.ops.tengyun.prefill_attention_bf16.default \
            if hasattr(torch.ops.tengyun, "prefill_attention_bf16") else None

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

    def write_kv_from_qkv(self, qkv, positions, cos_table, sin_table, k_cache, v_cache, meta: AttentionMetadata,
                          num_heads: int) -> bool:
        """Rotary and both cache writes of any step in one compiled call (layer_ops.cpp
        qkv_to_cache_): for a 128-token prompt of SmolLM2 21 us a layer instead of 65 us in
        rotary_neox_at_ and two index_copy_ (2 threads, AMX VM). Only where the cache has qkv's
        dtype."""
        if qkv.dtype != k_cache.dtype or qkv.stride(-1) != 1:
            return False
        self._qkv_to_cache(qkv, cos_table, sin_table, positions, k_cache, v_cache, meta.slot_mapping, num_heads,
                           k_cache.shape[2])
        return True

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
        """As torch_sdpa's, with the chunks the kernels take in them (their K/V, like everyone's,
        are in the cache already: write_kv runs first)."""
        step = _step_chunks(meta, q.dtype, k_cache.dtype, q.shape[-1])
        if step.paged is None and step.tiled is None:
            return super().forward(q, k, v, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        n = meta.num_decode_tokens
        if n:
            out[:n] = self._decode(q[:n], k_cache, v_cache, meta, scale)
        for chunks, tiled in ((step.paged, False), (step.tiled, True)):
            if chunks is not None:
                queries = q[chunks.rows].contiguous()  # [T', Hq, D]
                attended = torch.empty_like(queries)
                kernel = self._tiled_prefill if tiled else self._paged_decode
                kernel(attended, queries, k_cache, v_cache, chunks.block_tables, chunks.seq_lens, scale,
                       chunks.query_start_loc)
                out[chunks.rows] = attended
        self._prefill_chunks(out, q, k, v, k_cache, v_cache, step.others, meta, scale)
        return out


def _step_chunks(meta: AttentionMetadata, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> StepChunks:
    """meta's chunks by kernel for this dtype and head dim, cached in meta.backend_state for the
    step's other layers: the tiled kernel's (tiled_prefill), then the paged kernel's (in_kernel),
    the rest torch_sdpa's."""
    if "kernel_chunks" not in meta.backend_state:
        tiled_runs = tiled_prefill_runs(dtype, cache_dtype, head_dim)
        tiled = [c for c in meta.prefills if tiled_prefill(c, tiled_runs)]
        rest = [c for c in meta.prefills if not tiled_prefill(c, tiled_runs)]
        paged = [c for c in rest if in_kernel(c, dtype)]
        meta.backend_state["kernel_chunks"] = StepChunks(_build_kernel_chunks(paged) if paged else None,
                                                         _build_kernel_chunks(tiled) if tiled else None,
                                                         [c for c in rest if not in_kernel(c, dtype)])
    return meta.backend_state["kernel_chunks"]


def _build_kernel_chunks(chunks: list[PrefillChunk]) -> KernelChunks:
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
    return KernelChunks(rows, starts, seq_lens, tables)
