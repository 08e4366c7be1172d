"""Parameters of a decoder-only checkpoint per card, from its ModelSpec (config.json alone).

Counts follow the tensors in HF checkpoints of Llama, Qwen2/2.5, Qwen3, Qwen2-MoE, Qwen3-MoE,
Qwen3-Next and Qwen3.5 (dense and MoE, text decoder only: vision towers are not counted; MTP
heads only when asked for, ``mtp_layers``: --speculative-config method mtp). Under tensor
parallelism column/row-parallel weights split by tp, KV projections keep max(1, kv_heads / tp)
heads per rank (replicated when tp > kv heads), embeddings and LM head are vocab-parallel, MoE
experts split by tp (a slice of every expert, or with --enable-expert-parallel whole experts: the
same count per rank, expert_split says which), norms and routers replicate. Under data parallelism
every replica holds all of that again, except expert-parallel experts, which are divided among all
dp x tp ranks (``expert_ranks``): 512 experts over DP 4 x TP 8 = 16 whole experts per card.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from tengyun.model_spec import ModelSpec, as_spec


def _split(n: int, tp: int) -> int:
    return -(-n // tp)


def attention_params(spec: ModelSpec, tp: int) -> int:
    """q, k, v, o projections (+ biases, q/k norm) of one full-attention layer on one rank.
    Gated attention (Qwen3-Next / Qwen3.5) doubles q_proj's output for the sigmoid gate."""
    h, d, heads = spec.hidden_size, spec.head_dim, spec.num_attention_heads
    kv_rank = spec.kv_heads_per_rank(tp)
    q_out = heads * d * (2 if spec.gated_attention else 1)
    n = _split(h * q_out, tp) + 2 * h * kv_rank * d + _split(heads * d * h, tp)
    if spec.qkv_bias:
        n += _split(q_out, tp) + 2 * kv_rank * d
    if spec.o_bias:
        n += h
    if spec.qk_norm:
        n += 2 * d
    return n


def linear_attention_params(spec: ModelSpec, tp: int) -> int:
    """One Gated DeltaNet layer on one rank: in_proj_qkvz [h -> 2*key_dim + 2*value_dim],
    in_proj_ba [h -> 2*v_heads], conv1d [(2*key_dim + value_dim) x kernel], dt_bias and A_log
    [v_heads each], gated norm [v_head_dim], out_proj [value_dim -> h]."""
    h, la = spec.hidden_size, spec.linear_attention
    nv, key_dim, value_dim = la.num_value_heads, la.key_dim, la.value_dim
    return (_split(h * (2 * key_dim + 2 * value_dim), tp) + _split(h * 2 * nv, tp)
            + _split(la.conv_dim * la.conv_kernel, tp) + _split(2 * nv, tp) + la.value_head_dim
            + _split(value_dim * h, tp))


def mlp_params(spec: ModelSpec, tp: int, layer: int, expert_ranks: int | None = None) -> int:
    """Dense SwiGLU MLP (gate, up, down) or the MoE block (experts, router, shared expert and
    its gate) of one layer on one rank. ``expert_ranks`` (default tp): the ranks the routed experts
    are divided among, dp x tp under data and expert parallelism (whole experts each)."""
    h = spec.hidden_size
    if not spec.sparse_layers[layer]:
        return _split(3 * h * spec.intermediate_size, tp)
    moe = spec.moe
    if expert_ranks is None or expert_ranks == tp:
        n = moe.num_experts * _split(3 * h * moe.intermediate_size, tp) + moe.num_experts * h
    else:
        n = moe.num_experts // expert_ranks * 3 * h * moe.intermediate_size + moe.num_experts * h
    if moe.shared_intermediate_size:
        n += _split(3 * h * moe.shared_intermediate_size, tp) + h
    return n


def expert_split(spec: ModelSpec, tp: int, expert_parallel: bool, dp: int = 1) -> str | None:
    """How one MoE layer's routed experts lie on a card, worked out; None without experts.
    Either way a card holds num_experts x 3 x hidden x moe_intermediate / (tp, or dp x tp under
    data and expert parallelism) expert parameters."""
    moe, h = spec.moe, spec.hidden_size
    if moe is None:
        return None
    experts, inter = moe.num_experts, moe.intermediate_size
    if expert_parallel:
        ranks = tp * dp
        local = experts // ranks
        group = f"{ranks} EP ranks (DP {dp} x TP {tp}, --enable-expert-parallel)" if dp > 1 else \
            f"{ranks} EP ranks (--enable-expert-parallel)"
        return (f"{experts} experts / {group} = {local} whole experts x 3 x {h} x "
                f"{inter} = {local * 3 * h * inter:,} params per MoE layer")
    return (f"all {experts} experts, each a {inter} / {tp} = {inter // tp}-row slice (tensor parallel; "
            f"--enable-expert-parallel: whole experts) x 3 x {h} = {experts * 3 * h * (inter // tp):,} params "
            f"per MoE layer")


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank of pipeline stage ``stage`` holds, by component."""

    stage: int
    layers: tuple[int, int]  # [start, end)
    embedding: int
    attention: int  # all full-attention layers of the stage
    linear_attention: int
    mlp: int
    norms: int
    lm_head: int
    mtp: int = 0  # the MTP head (--speculative-config method mtp), on the last stage

    @property
    def total(self) -> int:
        return (self.embedding + self.attention + self.linear_attention + self.mlp + self.norms + self.lm_head
                + self.mtp)


def mtp_params(spec: ModelSpec, tp: int, num_layers: int, own_embedding: bool) -> int:
    """The MTP head on one rank (models/qwen3_5_mtp.py): fc [2h -> h] (replicated), its two pre-fc
    norms and final norm, ``num_layers`` full-attention decoder layers (layer j's MLP by decoder
    layer j's rule, as the engine builds it), and with ``own_embedding`` (a last pipeline stage
    that is not the first) its own vocab-parallel copy of the embedding."""
    h = spec.hidden_size
    layers = sum(attention_params(spec, tp) + mlp_params(spec, tp, j) + 2 * h for j in range(num_layers))
    return 2 * h * h + 3 * h + layers + (_split(spec.vocab_size, tp) * h if own_embedding else 0)


def stage_params(spec: ModelSpec, tp: int, pp: int, stage: int, tied_head_copy: bool = False,
                 mtp_layers: int = 0, pooling: bool = False, expert_ranks: int | None = None) -> StageParams:
    """Per-rank parameters of pipeline stage ``stage`` (its layers: spec.stage_layers). The first
    stage holds the embedding; the last the final norm and LM head (tied embeddings still need
    the LM head on the last stage when pp > 1, and where the platform's linear kernel keeps its own
    repacked copy of the weight next to the embedding's: ``tied_head_copy``, Platform.tied_head_copy), and the
    MTP head's ``mtp_layers`` with --speculative-config method mtp. A ``pooling`` model (--runner
    pooling) has no LM head (a classifier's score layer, labels x hidden, is not counted)."""
    h, vocab = spec.hidden_size, spec.vocab_size
    start, end = spec.stage_layers(stage, pp)
    layers = range(start, end)
    attention = sum(attention_params(spec, tp) for i in layers if spec.layer_is_attention(i))
    linear = sum(linear_attention_params(spec, tp) for i in layers if not spec.layer_is_attention(i))
    mlp = sum(mlp_params(spec, tp, i, expert_ranks) for i in layers)
    last = stage == pp - 1
    embed = _split(vocab, tp) * h if stage == 0 else 0
    lm_head = _split(vocab, tp) * h if last and (not spec.tie_word_embeddings or pp > 1 or tied_head_copy) else 0
    lm_head = 0 if pooling else lm_head
    mtp = mtp_params(spec, tp, mtp_layers, own_embedding=pp > 1) if last and mtp_layers else 0
    return StageParams(stage, (start, end), embed, attention, linear, mlp, 2 * h * (end - start) + (h if last else 0),
                       lm_head, mtp)


def total_params(config: ModelSpec | Mapping[str, Any]) -> int:
    """All decoder parameters (tp = pp = 1)."""
    return stage_params(as_spec(config), 1, 1, 0).total


@dataclass(frozen=True)
class LinearShape:
    """A linear layer on one rank, as a quantised checkpoint names it: ``parts`` are the
    checkpoint modules fused into it (q/k/v_proj -> qkv_proj); ``out`` x ``in_`` its features on
    this rank, ``in_total`` its inputs before a row-parallel split; ``count`` of them (a rank's MoE
    experts, all named and quantised as expert 0); ``part_outs`` the features of each part on this
    rank where a format may store the parts in different schemes (QuantConfig.mixed_shards)."""

    parts: tuple[str, ...]
    out: int
    in_: int
    in_total: int
    count: int = 1
    part_outs: tuple[int, ...] = ()


def _mlp_linears(prefix: str, inter: int, h: int, tp: int) -> list[LinearShape]:
    """gate/up (column-parallel, fused) and down (row-parallel) of a SwiGLU MLP at ``prefix``."""
    return [LinearShape((f"{prefix}.gate_proj", f"{prefix}.up_proj"), 2 * inter // tp, h, h,
                        part_outs=(inter // tp, inter // tp)),
            LinearShape((f"{prefix}.down_proj",), h, inter // tp, inter)]


def decoder_linears(spec: ModelSpec, tp: int, layer: int, expert_ranks: int | None = None) -> list[LinearShape]:
    """Every linear layer of decoder layer ``layer`` a quantised checkpoint may store packed:
    attention or Gated DeltaNet projections, the dense MLP, or the MoE block's experts (split by
    expert id), router, shared expert and its gate."""
    h, d, heads = spec.hidden_size, spec.head_dim, spec.num_attention_heads
    prefix = f"model.layers.{layer}"
    if spec.layer_is_attention(layer):
        q_out = heads * d * (2 if spec.gated_attention else 1)
        qkv = tuple(f"{prefix}.self_attn.{p}_proj" for p in "qkv")
        kv_out = spec.kv_heads_per_rank(tp) * d
        linears = [LinearShape(qkv, q_out // tp + 2 * kv_out, h, h, part_outs=(q_out // tp, kv_out, kv_out)),
                   LinearShape((f"{prefix}.self_attn.o_proj",), h, heads * d // tp, heads * d)]
    else:
        la, at = spec.linear_attention, f"{prefix}.linear_attn"
        linears = [LinearShape((f"{at}.in_proj_qkv",), la.conv_dim // tp, h, h),
                   LinearShape((f"{at}.in_proj_z",), la.value_dim // tp, h, h),
                   LinearShape((f"{at}.in_proj_b",), la.num_value_heads // tp, h, h),
                   LinearShape((f"{at}.in_proj_a",), la.num_value_heads // tp, h, h),
                   LinearShape((f"{at}.out_proj",), h, la.value_dim // tp, la.value_dim)]
    if not spec.sparse_layers[layer]:
        dense = spec.intermediate_size
        return linears + (_mlp_linears(f"{prefix}.mlp", dense, h, tp) if dense else [])
    moe, experts, local = spec.moe, f"{prefix}.mlp.experts.0", spec.moe.num_experts // (expert_ranks or tp)
    linears += [LinearShape((f"{experts}.gate_proj", f"{experts}.up_proj"), 2 * moe.intermediate_size, h, h, local),
                LinearShape((f"{experts}.down_proj",), h, moe.intermediate_size, moe.intermediate_size, local),
                LinearShape((f"{prefix}.mlp.gate",), moe.num_experts, h, h)]
    if moe.shared_intermediate_size:
        linears += _mlp_linears(f"{prefix}.mlp.shared_expert", moe.shared_intermediate_size, h, tp)
        linears.append(LinearShape((f"{prefix}.mlp.shared_expert_gate",), 1, h, h))
    return linears
