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


def copy_kv_blocks(model: nn.Module, copies: list[tuple[int, int]]) -> None:
    """Copy whole KV blocks, (src, dst) pairs, in every attention layer: [(3, 7)] -> block 7 of each
    layer's k and v cache holds what block 3 does."""
    for layer in model.modules():
        if isinstance(layer, Attention) and layer.k_cache.numel():
            src = torch.tensor([s for s, _ in copies], device=layer.k_cache.device)
            dst = torch.tensor([d for _, d in copies], device=layer.k_cache.device)
            layer.k_cache[dst] = layer.k_cache[src]
            layer.v_cache[dst] = layer.v_cache[src]


def release_kv_cache(model: nn.Module) -> None:
    """Every attention layer unbound from its cache (as built), so that the cache can be freed."""
    for layer in model.modules():
        if isinstance(layer, Attention):
            layer.k_cache, layer.v_cache = torch.empty(0), torch.empty(0)
