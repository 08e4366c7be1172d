"""Parameters of a decoder-only checkpoint per card, from config.json alone.

Counts follow the tensors in HF checkpoints of Llama, Qwen2/2.5, Qwen3, Qwen2-MoE, Qwen3-MoE,
Qwen3-Next and Qwen3.5 (dense and MoE, text decoder only: vision towers and MTP heads are not
counted). Under tensor parallelism column/row-parallel weights split by tp, KV projections keep
max(1, kv_heads / tp) heads per rank (replicated when tp > kv heads), embeddings and LM head are
vocab-parallel, MoE experts split by tp (no expert parallelism), norms and routers replicate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


GATED_ATTENTION_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
QK_NORM_TYPES = ("qwen3", "qwen3_moe") + GATED_ATTENTION_TYPES
QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")


def decoder_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields at the top level: a multimodal wrapper's "text_config"
    (Qwen3.5) is lifted out; a hybrid config without "layer_types" (Qwen3-Next) gets them from
    full_attention_interval (every n-th layer full attention, the rest linear attention; n is 4
    when absent, as in transformers). The engine reads config.json through this too."""
    cfg = dict(hf_config)
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**{k: v for k, v in cfg.items() if not k.endswith("_config")}, **cfg["text_config"]}
    interval = cfg.get("full_attention_interval") or 4
    if not cfg.get("layer_types") and cfg.get("linear_num_value_heads"):
        cfg["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                              for i in range(cfg["num_hidden_layers"])]
    return cfg


def layer_is_attention(cfg: dict[str, Any], layer: int) -> bool:
    """Does decoder layer ``layer`` keep KV (anything but a linear-attention layer)?"""
    types = cfg.get("layer_types") or []
    return layer >= len(types) or types[layer] != "linear_attention"


def stage_layer_range(num_layers: int, stage: int, pp: int) -> tuple[int, int]:
    """[start, end) of the layers pipeline stage ``stage`` holds, as the engine splits them
    (distributed/parallel_state.pp_layer_range, kept equal by a test): earlier stages take the
    remainder. 10 layers, 4 stages -> (0, 3) (3, 6) (6, 8) (8, 10)."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)


def _split(n: int, tp: int) -> int:
    return -(-n // tp)


def head_dim(cfg: dict[str, Any]) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def attention_params(cfg: dict[str, Any], tp: int) -> int:
    """q, k, v, o projections (+ qkv bias, q/k norm) of one full-attention layer on one rank.
    Gated attention (Qwen3-Next / Qwen3.5) doubles q_proj's output for the sigmoid gate."""
    h, d = cfg["hidden_size"], head_dim(cfg)
    heads = cfg["num_attention_heads"]
    kv_rank = max(1, (cfg.get("num_key_value_heads") or heads) // tp)
    model_type = cfg.get("model_type", "")
    q_out = heads * d * (2 if model_type in GATED_ATTENTION_TYPES or cfg.get("attn_output_gate") else 1)
    n = _split(h * q_out, tp) + 2 * h * kv_rank * d + _split(heads * d * h, tp)
    if model_type in QKV_BIAS_TYPES or cfg.get("attention_bias"):
        n += _split(q_out, tp) + 2 * kv_rank * d + (h if cfg.get("attention_bias") else 0)
    if model_type in QK_NORM_TYPES:
        n += 2 * d
    return n


def linear_attention_params(cfg: dict[str, Any], tp: int) -> int:
    """One Gated DeltaNet layer on one rank: in_proj_qkvz [h -> 2*key_dim + 2*value_dim],
    in_proj_ba [h -> 2*v_heads], conv1d [(2*key_dim + value_dim) x kernel], dt_bias and A_log
    [v_heads each], gated norm [v_head_dim], out_proj [value_dim -> h]."""
    h = cfg["hidden_size"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    key_dim, value_dim = nk * cfg["linear_key_head_dim"], nv * cfg["linear_value_head_dim"]
    return (_split(h * (2 * key_dim + 2 * value_dim), tp) + _split(h * 2 * nv, tp)
            + _split((2 * key_dim + value_dim) * cfg.get("linear_conv_kernel_dim", 4), tp)
            + _split(2 * nv, tp) + cfg["linear_value_head_dim"] + _split(value_dim * h, tp))


def num_experts(cfg: dict[str, Any]) -> int:
    """Routed experts: "num_experts" in Qwen's configs, "num_local_experts" as transformers 5 saves them."""
    return cfg.get("num_experts") or cfg.get("num_local_experts") or 0


def layer_is_sparse(cfg: dict[str, Any], layer: int) -> bool:
    """MoE layer? Qwen2/3-MoE style: experts > 0, not in mlp_only_layers, every
    decoder_sparse_step-th layer."""
    if not num_experts(cfg):
        return False
    step = cfg.get("decoder_sparse_step") or 1
    return layer not in (cfg.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def mlp_params(cfg: dict[str, Any], tp: int, layer: int) -> int:
    """Dense SwiGLU MLP (gate, up, down) or the MoE block (experts, router, shared expert and
    its gate) of one layer on one rank."""
    h = cfg["hidden_size"]
    if not layer_is_sparse(cfg, layer):
        return _split(3 * h * cfg["intermediate_size"], tp)
    experts = num_experts(cfg)
    n = experts * _split(3 * h * cfg["moe_intermediate_size"], tp) + experts * h
    shared = cfg.get("shared_expert_intermediate_size") or 0
    if shared:
        n += _split(3 * h * shared, tp) + h
    return n


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

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.linear_attention + self.mlp + self.norms + self.lm_head


def stage_params(hf_config: dict[str, Any], tp: int, pp: int, stage: int,
                 layers: tuple[int, int]) -> StageParams:
    """Per-rank parameters of pipeline stage ``stage`` holding decoder ``layers``. The first
    stage holds the embedding; the last the final norm and LM head (tied embeddings still need
    the LM head on the last stage when pp > 1)."""
    cfg = decoder_config(hf_config)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    start, end = layers
    attention = sum(attention_params(cfg, tp) for i in range(start, end) if layer_is_attention(cfg, i))
    linear = sum(linear_attention_params(cfg, tp) for i in range(start, end) if not layer_is_attention(cfg, i))
    mlp = sum(mlp_params(cfg, tp, i) for i in range(start, end))
    last = stage == pp - 1
    tied = bool(cfg.get("tie_word_embeddings", hf_config.get("tie_word_embeddings", False)))
    embed = _split(vocab, tp) * h if stage == 0 else 0
    lm_head = _split(vocab, tp) * h if last and (not tied or pp > 1) else 0
    return StageParams(stage, layers, embed, attention, linear, mlp, 2 * h * (end - start) + (h if last else 0),
                       lm_head)


def total_params(hf_config: dict[str, Any]) -> int:
    """All decoder parameters (tp = pp = 1)."""
    layers = decoder_config(hf_config)["num_hidden_layers"]
    return stage_params(hf_config, 1, 1, 0, (0, layers)).total
