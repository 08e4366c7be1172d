"""Attention layer: writes this step's K/V to its cache slots, then attends (paged)."""

from __future__ import annotations

import torch
from torch import nn

from tengyun.layers.attention.backend import AttentionBackend
from tengyun.layers.attention.metadata import get_attention_metadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        # Bound by the model runner once the cache is allocated.
        self.backend: AttentionBackend | None = None
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq * D], k/v [T, Hkv * D] -> [T, Hq * D]."""
        meta = get_attention_metadata()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        self.backend.write_kv(k, v, self.k_cache, self.v_cache, meta)
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return out.flatten(1)
