"""Paged attention on CPU with the compiled decode kernel (tengyun/csrc/paged_attention.cpp).

Decodes read their K/V blocks in place from the paged cache (no gather copy; 16-bit caches widened
a row at a time, float32 accumulation, the next block prefetched), one OpenMP task per (sequence,
KV head). Writing K/V and prefill chunks are torch_sdpa's, unchanged. Picked by
``CpuPlatform.attention_backend`` only when the kernel library loads (cpu_kernels.py).
"""

from __future__ import annotations

import torch

from tengyun.layers.attention import cpu_kernels
from tengyun.layers.attention.metadata import AttentionMetadata
from tengyun.layers.attention.torch_sdpa import TorchSDPABackend


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
