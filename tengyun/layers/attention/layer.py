"""Attention layer: writes this step's K/V to its cache slots, then attends (paged)."""

from __future__ import annotations

import torch
from torch import nn

from tengyun.layers.attention.backend import AttentionBackend
from tengyun.layers.attention.metadata import get_attention_metadata
from tengyun.layers.attention.torch_sdpa import TorchSDPABackend
from tengyun.layers.kernels import KernelBundle


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        self.backend: AttentionBackend = TorchSDPABackend()  # the platform's once bound (bind_kernels)
        # Bound by the worker once the cache is allocated (worker/kv_cache.py).
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def bind_kernels(self, kernels: KernelBundle) -> None:
        self.backend = kernels.attention

    def from_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor) -> torch.Tensor | None:
        """The attention of a step from the qkv projection [T, (Hq + 2 Hkv) D] with full-width neox
        rotary (tables [P, D / 2]) -> [T, Hq * D], where the backend takes qkv whole: a decode-only
        step as decode_from_qkv, any other with rotary and the cache writes in one call
        (write_kv_from_qkv). None: the backend does neither; rotate and call forward instead."""
        meta = get_attention_metadata()
        if not meta.prefills and meta.num_decode_tokens == qkv.shape[0]:
            out = self.backend.decode_from_qkv(qkv, positions, cos_table, sin_table, self.k_cache, self.v_cache,
                                               meta, self.scale, self.num_heads)
            if out is not None:
                return out
        if not self.backend.write_kv_from_qkv(qkv, positions, cos_table, sin_table, self.k_cache, self.v_cache,
                                              meta, self.num_heads):
            return None
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([self.num_heads * self.head_dim, kv_size, kv_size], dim=-1)  # views, q and k turned
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale).flatten(1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq * D], k/v [T, Hkv * D] -> [T, Hq * D]."""
        meta = get_attention_metadata()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        self.backend.write_kv(k, v, self.k_cache, self.v_cache, meta)
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return out.flatten(1)
