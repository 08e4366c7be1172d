"""KV-cache sizing shared by the engine's allocator and `tengyun plan` (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass

from tengyun.model_spec import ModelSpec


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


def kv_cache_shape(spec: ModelSpec, dtype_bytes: int, tp_size: int = 1, start: int = 0,
                   end: int | None = None, extra_layers: int = 0) -> KVCacheShape:
    """Per rank, for the attention layers in [start, end) (a pipeline stage; default all) and
    ``extra_layers`` more (the MTP head's, on the last stage: its own cache under the same block
    ids): KV heads split over TP ranks (1 each, replicated, when tp > num_key_value_heads)."""
    return KVCacheShape(num_layers=spec.attention_layers(start, end) + extra_layers,
                        num_kv_heads=spec.kv_heads_per_rank(tp_size),
                        head_dim=spec.head_dim, dtype_bytes=dtype_bytes)


def activation_estimate(spec: ModelSpec, tp: int, tokens: int, max_num_seqs: int,
                        act_bytes: int, pooling: bool = False) -> tuple[int, str]:
    """Peak transient memory of one step, per rank: what an accelerator keeps free besides weights
    and KV (`tengyun plan` subtracts it; --activation-reserve there overrides):
    tokens x (4 x hidden [residual, hidden, normed, attention out] + widest per-rank projection
    output [qkv, gate_up, routed experts' gate_up or linear attention's qkvz]) x dtype bytes,
    plus fp32 logits of every sequence that samples: max_num_seqs x vocab x 4 (a pooling model,
    --runner pooling, samples nothing: its pooled rows, max_num_seqs x hidden x 4, instead)."""
    h, d = spec.hidden_size, spec.head_dim
    q_heads = spec.num_attention_heads * (2 if spec.gated_attention else 1)
    widest = q_heads * d // tp + 2 * spec.kv_heads_per_rank(tp) * d
    if not all(spec.sparse_layers):
        widest = max(widest, 2 * spec.intermediate_size // tp)
    if any(spec.sparse_layers):
        routed = spec.moe.top_k * 2 * spec.moe.intermediate_size
        widest = max(widest, (routed + 2 * spec.moe.shared_intermediate_size) // tp)
    if spec.linear_attention:
        widest = max(widest, 2 * (spec.linear_attention.key_dim + spec.linear_attention.value_dim) // tp)
    step = tokens * (4 * h + widest) * act_bytes
    width, what = (h, "hidden (pooled)") if pooling else (spec.vocab_size, "vocab")
    logits = max_num_seqs * width * 4
    formula = (f"{tokens} tokens x (4 x {h} + {widest}) x {act_bytes} B + "
               f"{max_num_seqs} seqs x {width} {what} x 4 B")
    return step + logits, formula


# ----- hybrid models (Qwen3.5): linear-attention layers keep per-sequence state, not KV -------
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


def state_shape(spec: ModelSpec, dtype_bytes: int, start: int = 0, end: int | None = None,
                tp_size: int = 1) -> StateShape:
    """Per tensor-parallel rank (its 1/tp of the key and value heads), for the linear-attention
    layers in [start, end). Qwen3.5-27B (48 linear layers, 16 key / 48 value heads of 128,
    kernel 4, bf16), tp 1: 48 * (10240 * 3 * 2 + 48 * 128 * 128 * 4) bytes = 147.4 MiB per sequence.
    A model without linear attention: 0 layers, 0 bytes per slot."""
    end = spec.num_layers if end is None else end
    linear = spec.linear_attention
    if linear is None:
        return StateShape(0, 0, 0, 0, 0, 0, dtype_bytes)
    return StateShape(
        num_layers=(end - start) - spec.attention_layers(start, end),
        conv_dim=linear.conv_dim // tp_size,
        conv_width=linear.conv_kernel - 1,
        num_v_heads=linear.num_value_heads // tp_size,
        k_head_dim=linear.key_head_dim,
        v_head_dim=linear.value_head_dim,
        dtype_bytes=dtype_bytes,
    )


def split_budget(budget_bytes: int, block_size: int, shape: KVCacheShape, slot_bytes: int,
                 max_num_seqs: int, max_model_len: int, prefix_caching: bool = False) -> tuple[int, int, int]:
    """(KV blocks, state slots, state snapshots) from one budget. Slots first, max_num_seqs of
    them, fewer when the budget would then not hold one max_model_len sequence of KV (at least
    1). With prefix caching, snapshot rows of the state (docs/hybrid_cache.md) take at most half
    of what is left, never the last max_model_len sequence of KV, and at most one per slot;
    blocks get the rest. E.g. 2 GiB, 6.28 MiB per slot, 256 KiB blocks, max_model_len 2048, 256
    seqs: 256 slots (1.57 GiB), 35 snapshots (0.21 GiB), 880 blocks (1,760 with prefix caching
    off). slot_bytes 0 (no linear-attention layers): every byte to blocks, no slots or snapshots."""
    block_bytes = shape.bytes_per_block(block_size) if shape.num_layers else 0
    if slot_bytes == 0:
        return budget_bytes // block_bytes, 0, 0
    one_sequence = -(-max_model_len // block_size) * block_bytes
    slots = max(1, min(max_num_seqs, (budget_bytes - one_sequence) // slot_bytes))
    rest = max(budget_bytes - slots * slot_bytes, 0)
    snapshots = max(0, min(slots, min(rest // 2, rest - one_sequence) // slot_bytes)) if prefix_caching else 0
    rest -= snapshots * slot_bytes
    # No KV layers here (a pipeline stage): blocks cost nothing.
    return (rest // block_bytes if block_bytes else rest), slots, snapshots
