"""The attention-backend interface: CUDA and Ascend kernels replace the torch one here (the
backends by name: tengyun/platforms/attention_backends.py)."""

from __future__ import annotations

import torch

from tengyun.layers.attention.metadata import AttentionMetadata


class AttentionBackend:
    """Stores new K/V into a paged cache and attends over it.

    Cache layout (per layer): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim].
    """

    name = ""
    # True when decodes can be captured into a graph: no host syncs, and a static
    # AttentionMetadata.decode_max_len costs nothing extra (the kernel reads the block table).
    supports_decode_graphs = False

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """k/v [T, Hkv, D] into cache slots meta.slot_mapping [T] (block * block_size + offset),
        in the cache's dtype; plain PyTorch, any device."""
        num_kv_heads, head_dim = k_cache.shape[-2:]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

    def decode_from_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                        sin_table: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, num_heads: int) -> torch.Tensor | None:
        """A decode-only step taken whole from the qkv projection: qkv [T, (Hq + 2 Hkv) D] ->
        [T, Hq * D], q and k turned by full-width neox rotary at ``positions`` (rows of the float32
        [P, D / 2] tables), k and v written to the cache. None: this backend does not; the caller
        splits, rotates, writes and attends op by op (the same arithmetic)."""
        return None

    def write_kv_from_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                          sin_table: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, num_heads: int) -> bool:
        """Any step's tokens from the qkv projection [T, (Hq + 2 Hkv) D]: q and k turned in place
        in qkv by full-width neox rotary at ``positions`` (rows of the float32 [P, D / 2] tables),
        then k and v written to the cache, as rotary and write_kv would. False: this backend does
        not; the caller does both op by op."""
        return False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (this step's tokens, already in the cache) -> [T, Hq, D]."""
        raise NotImplementedError

