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


def kv_cache_shape(hf_config: dict[str, Any], dtype_bytes: int, tp_size: int = 1,
                   num_layers: int | None = None) -> KVCacheShape:
    """Per rank: KV heads split over TP ranks (1 each, replicated, when tp > num_key_value_heads);
    ``num_layers``: this pipeline stage's layers (default all)."""
    num_heads = hf_config["num_attention_heads"]
    num_kv_heads = hf_config.get("num_key_value_heads") or num_heads
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // num_heads
    return KVCacheShape(
        num_layers=hf_config["num_hidden_layers"] if num_layers is None else num_layers,
        num_kv_heads=max(1, num_kv_heads // tp_size),
        head_dim=head_dim,
        dtype_bytes=dtype_bytes,
    )


def num_blocks_for_budget(budget_bytes: int, block_size: int, shape: KVCacheShape) -> int:
    return budget_bytes // shape.bytes_per_block(block_size)


# ----- hybrid models (Qwen3.5): linear-attention layers keep per-sequence state, not KV -------
def is_hybrid(hf_config: dict[str, Any]) -> bool:
    return "linear_attention" in (hf_config.get("layer_types") or [])


def attention_layer_count(hf_config: dict[str, Any], start: int = 0, end: int | None = None) -> int:
    """Layers in [start, end) that keep KV: all of them, or the "full_attention" ones of a hybrid."""
    end = hf_config["num_hidden_layers"] if end is None else end
    types = hf_config.get("layer_types") or ["full_attention"] * hf_config["num_hidden_layers"]
    return sum(t == "full_attention" for t in types[start:end])


@dataclass(frozen=True)
class StateShape:
    """Per sequence slot, per Gated DeltaNet layer: conv state [conv_dim, kernel - 1] in the model
    dtype and SSM state [num_v_heads, k_head_dim, v_head_dim] in float32."""

    num_layers: int
    conv_dim: int  # q, k and v channels: 2 * key heads * k_head_dim + value heads * v_head_dim
    conv_width: int  # linear_conv_kernel_dim - 1
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_slot(self) -> int:
        conv = self.conv_dim * self.conv_width * self.dtype_bytes
        ssm = self.num_v_heads * self.k_head_dim * self.v_head_dim * 4
        return self.num_layers * (conv + ssm)


def state_shape(hf_config: dict[str, Any], dtype_bytes: int, start: int = 0, end: int | None = None,
                tp_size: int = 1) -> StateShape:
    """Per tensor-parallel rank (its 1/tp of the key and value heads). Qwen3.5-27B (48 linear
    layers, 16 key / 48 value heads of 128, kernel 4, bf16), tp 1:
    48 * (10240 * 3 * 2 + 48 * 128 * 128 * 4) bytes = 147.4 MiB per sequence."""
    end = hf_config["num_hidden_layers"] if end is None else end
    key_dim = hf_config.get("linear_num_key_heads", 0) * hf_config.get("linear_key_head_dim", 0)
    value_heads, value_dim = hf_config.get("linear_num_value_heads", 0), hf_config.get("linear_value_head_dim", 0)
    return StateShape(
        num_layers=(end - start) - attention_layer_count(hf_config, start, end),
        conv_dim=(2 * key_dim + value_heads * value_dim) // tp_size,
        conv_width=hf_config.get("linear_conv_kernel_dim", 4) - 1,
        num_v_heads=value_heads // tp_size,
        k_head_dim=hf_config.get("linear_key_head_dim", 0),
        v_head_dim=value_dim,
        dtype_bytes=dtype_bytes,
    )


def split_budget(budget_bytes: int, block_size: int, shape: KVCacheShape, slot_bytes: int,
                 max_num_seqs: int, max_model_len: int) -> tuple[int, int]:
    """(KV blocks, state slots) from one budget. Slots first, max_num_seqs of them, fewer when
    the budget would then not hold one max_model_len sequence of KV (at least 1); blocks get
    the rest. slot_bytes 0 (no linear-attention layers): every byte to blocks, 0 slots."""
    block_bytes = shape.bytes_per_block(block_size) if shape.num_layers else 0
    if slot_bytes == 0:
        return budget_bytes // block_bytes, 0
    one_sequence = -(-max_model_len // block_size) * block_bytes
    slots = max(1, min(max_num_seqs, (budget_bytes - one_sequence) // slot_bytes))
    rest = max(budget_bytes - slots * slot_bytes, 0)
    return (rest // block_bytes if block_bytes else rest), slots  # no KV layers here: blocks cost nothing
