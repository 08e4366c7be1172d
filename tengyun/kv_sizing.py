"""KV-cache sizing shared by the engine's allocator and `tengyun plan` (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int  # per tensor-parallel rank
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        """K and V, every layer: 2 * layers * kv_heads * head_dim * dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size


def kv_cache_shape(hf_config: dict[str, Any], dtype_bytes: int, tp_size: int = 1) -> KVCacheShape:
    num_heads = hf_config["num_attention_heads"]
    num_kv_heads = hf_config.get("num_key_value_heads") or num_heads
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // num_heads
    return KVCacheShape(
        num_layers=hf_config["num_hidden_layers"],
        num_kv_heads=max(1, num_kv_heads // tp_size),
        head_dim=head_dim,
        dtype_bytes=dtype_bytes,
    )


def num_blocks_for_budget(budget_bytes: int, block_size: int, shape: KVCacheShape) -> int:
    return budget_bytes // shape.bytes_per_block(block_size)
