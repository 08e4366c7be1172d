"""Allocates the paged KV cache and binds each attention layer to its slice."""

from __future__ import annotations

import torch
from torch import nn

from tengyun.sizing.cache import KVCacheShape
from tengyun.layers.attention.layer import Attention


def allocate_kv_cache(model: nn.Module, shape: KVCacheShape, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One tensor [2, layers, num_blocks, block_size, kv_heads, head_dim]; returns it."""
    cache = torch.zeros(2, shape.num_layers, num_blocks, block_size, shape.num_kv_heads, shape.head_dim,
                        dtype=dtype, device=device)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert len(layers) == shape.num_layers, f"{len(layers)} attention layers, {shape.num_layers} expected"
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    return cache


def release_kv_cache(model: nn.Module) -> None:
    """Every attention layer unbound from its cache (as built), so that the cache can be freed."""
    for layer in model.modules():
        if isinstance(layer, Attention):
            layer.k_cache, layer.v_cache = torch.empty(0), torch.empty(0)
