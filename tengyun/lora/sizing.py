"""Bytes the LoRA slots take on one rank, without torch: what LoRAManager allocates
(tengyun/layers/lora/layer.py: a [L, S R, in] and b [L, S R, out] per targeted linear, L =
--max-loras, R = --max-lora-rank, S the layer's slices), for a planner to set beside the weights.

    Qwen2.5-0.5B (24 layers, hidden 896, q 896, kv 128, intermediate 4864), 4 slots of rank 16,
    bfloat16, TP 1: per layer qkv 3*16*(896+1152) + o 16*(896+896) + gate_up 2*16*(896+9728)
    + down 16*(4864+896) = 559,104 elements x 4 slots x 2 bytes -> 4.3 MiB; 24 layers 102 MiB.
"""

from __future__ import annotations

from tengyun.model_spec import ModelSpec


def lora_slot_bytes(spec: ModelSpec, tp: int, num_layers: int, max_loras: int, max_lora_rank: int,
                    dtype_bytes: int) -> int:
    """The slots of ``num_layers`` decoder layers on one of ``tp`` ranks."""
    q = spec.num_attention_heads * spec.head_dim // tp
    kv = max(1, spec.num_kv_heads // tp) * spec.head_dim
    hidden, inter = spec.hidden_size, spec.intermediate_size // tp
    # (slices, in, out) of qkv_proj, o_proj, gate_up_proj, down_proj on this rank
    layers = ((3, hidden, q + 2 * kv), (1, q, hidden), (2, hidden, 2 * inter), (1, inter, hidden))
    per_layer = sum(slices * max_lora_rank * (in_ + out) for slices, in_, out in layers)
    return num_layers * per_layer * max_loras * dtype_bytes
