"""Paged attention on NVIDIA GPUs through flash-attn 2 (``pip install flash-attn``).

NOT YET RUN ON A GPU: written against flash-attn 2's documented Python API
(flash_attn/flash_attn_interface.py) and tested on CPU against a stand-in that implements
those documented semantics in plain torch (tests/layers/fake_flash_attn.py).

- K/V into the paged cache: ``index_copy_`` by slot, as torch_sdpa does (flash-attn has no
  standalone cache write; the Attention layer writes before it attends).
- Decodes: one ``flash_attn_with_kvcache`` over the paged cache, q [B, 1, Hq, D],
  ``block_table`` [B, max_blocks] and ``cache_seqlens`` [B] (int32, lengths including the
  new token). No host syncs, so decode graphs can capture it.
- Fresh prompts (context_len 0): one ``flash_attn_varlen_func`` over this step's own k/v,
  all of them packed (``cu_seqlens`` int32), causal.
- Later chunks of a prompt (context_len > 0: chunked prefill, prefix-cache hits): one
  ``flash_attn_with_kvcache`` each, q [1, L, Hq, D], ``cache_seqlens`` = context_len + L,
  causal; flash-attn aligns the causal mask to the bottom right, so query i sees keys
  0 .. context_len + i.

What the library requires, checked by ``CudaPlatform.attention_backend`` before it picks this
backend: a paged block size that is a multiple of 256 (the docstring of
flash_attn_with_kvcache; flash_api.cpp: "Paged KV cache block size must be divisible by 256")
and a float16 / bfloat16 cache (the only dtypes it takes; q is cast to the cache's dtype).
GQA is native: query head h reads KV head h // (Hq / Hkv), as torch_sdpa's enable_gqa.

Cache layout as every backend: k_cache, v_cache [num_blocks, block_size, Hkv, D].
"""

from __future__ import annotations

import torch

from tengyun.layers.attention.backend import AttentionBackend
from tengyun.layers.attention.metadata import AttentionMetadata, PrefillChunk

PAGE_BLOCK_MULTIPLE = 256
CACHE_DTYPES = ("float16", "bfloat16")


def flash_attn_import_error() -> str | None:
    """None when flash-attn 2's two calls import, else why not."""
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401
    except Exception as e:  # ImportError, or a CUDA extension built for another torch
        return f"flash_attn does not import: {type(e).__name__}: {e}"
    return None


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    supports_decode_graphs = True

    @staticmethod
    def _ops():
        import flash_attn

        return flash_attn

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        n = meta.num_decode_tokens
        if n:
            out[:n] = self._decode(q[:n], k_cache, v_cache, meta, scale)
        if any(chunk.context_len == 0 for chunk in meta.prefills):
            self._fresh_prompts(q, k, v, k_cache.dtype, out, meta, scale)
        for chunk in meta.prefills:
            if chunk.context_len:
                rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
                out[rows] = self._later_chunk(q[rows], k_cache, v_cache, chunk, meta, scale)
        return out

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [B, Hq, D] -> [B, Hq, D]."""
        tables = meta.backend_state.get("flash_decode")
        if tables is None:  # int32 copies, made once per step for all layers
            tables = meta.backend_state["flash_decode"] = (
                meta.decode_block_tables.to(torch.int32), meta.decode_seq_lens.to(torch.int32))
        block_table, seq_lens = tables
        out = self._ops().flash_attn_with_kvcache(
            q.unsqueeze(1).to(k_cache.dtype), k_cache, v_cache, cache_seqlens=seq_lens, block_table=block_table,
            softmax_scale=scale, causal=True,
        )
        return out[:, 0].to(q.dtype)

    def _fresh_prompts(self, q, k, v, dtype: torch.dtype, out, meta: AttentionMetadata, scale: float) -> None:
        """Every chunk with context_len 0, packed: rows of q/k/v -> the same rows of out."""
        packed = meta.backend_state.get("flash_fresh")
        if packed is None:
            fresh = [c for c in meta.prefills if c.context_len == 0]
            rows = torch.cat([torch.arange(c.query_start, c.query_start + c.query_len) for c in fresh])
            lens = torch.tensor([0] + [c.query_len for c in fresh])
            # e.g. query lens [3, 5] -> cu_seqlens [0, 3, 8]
            packed = meta.backend_state["flash_fresh"] = (
                rows.to(q.device), lens.cumsum(0).to(device=q.device, dtype=torch.int32),
                max(c.query_len for c in fresh))
        rows, cu_seqlens, max_len = packed
        o = self._ops().flash_attn_varlen_func(
            q[rows].to(dtype), k[rows].to(dtype), v[rows].to(dtype), cu_seqlens, cu_seqlens, max_len, max_len,
            softmax_scale=scale, causal=True,
        )
        out[rows] = o.to(q.dtype)

    def _later_chunk(self, q, k_cache, v_cache, chunk: PrefillChunk, meta: AttentionMetadata,
                     scale: float) -> torch.Tensor:
        """q [L, Hq, D] of a chunk after context_len cached tokens -> [L, Hq, D]."""
        key = ("flash_chunk", chunk.query_start)
        tables = meta.backend_state.get(key)
        if tables is None:
            total = chunk.context_len + chunk.query_len
            tables = meta.backend_state[key] = (
                chunk.block_table.to(torch.int32).unsqueeze(0),
                torch.tensor([total], dtype=torch.int32, device=q.device))
        block_table, seq_lens = tables
        out = self._ops().flash_attn_with_kvcache(
            q.unsqueeze(0).to(k_cache.dtype), k_cache, v_cache, cache_seqlens=seq_lens, block_table=block_table,
            softmax_scale=scale, causal=True,
        )
        return out[0].to(q.dtype)

