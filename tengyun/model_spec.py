"""ModelSpec: the one description of a decoder checkpoint, built once from its config.json.

Torch-free and frozen. The engine's config, the models, KV sizing and `tengyun plan` all read
it, so a fact about the model (KV heads per rank, which layers are linear attention, which are
MoE, how pipeline stages split the layers, the dtype "auto" means) is derived here only.

Covers Llama, Qwen2/2.5, Qwen3, Qwen3-MoE, Qwen3-Next and Qwen3.5 (dense and MoE; the text
decoder of the multimodal checkpoints). A multimodal wrapper's ``text_config`` is lifted to the
top level, keeping the wrapper's ``architectures`` and ``tie_word_embeddings``.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from tengyun.dtypes import DTYPE_ALIASES, DTYPE_BYTES, canonical_dtype  # noqa: F401  (re-exported)

FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
GATED_ATTENTION_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
QK_NORM_TYPES = ("qwen3", "qwen3_moe") + GATED_ATTENTION_TYPES
QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")
# Configs converted from GGUF carry model_type only.
MODEL_TYPE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                            "qwen3_moe": "Qwen3MoeForCausalLM"}

# Checkpoint tensors of the Qwen3.5 / Qwen3-Next releases that the text decoder does not load
# (prefix -> why): the loader skips them, `tengyun plan` leaves them out of the weights.
VISION_PREFIX, MTP_PREFIX = "model.visual.", "mtp."
UNLOADED_CHECKPOINT_PREFIXES = {
    VISION_PREFIX: "vision tower (Tengyun serves the text model only)",
    MTP_PREFIX: "multi-token-prediction layers (the draft model of --speculative-config method mtp, loaded apart)",
}
MULTIMODAL_TEXT_PREFIX = "model.language_model."  # a *ForConditionalGeneration checkpoint's text model


def text_model_name(name: str) -> str:
    """A multimodal checkpoint's text-model tensor or module name as Tengyun's text model calls it:
    'model.language_model.layers.0.mlp.up_proj' -> 'model.layers.0.mlp.up_proj'; others as they are."""
    return "model." + name[len(MULTIMODAL_TEXT_PREFIX):] if name.startswith(MULTIMODAL_TEXT_PREFIX) else name


MTP_ARCHITECTURES = ("Qwen3_5", "Qwen3Next")  # architecture prefixes whose mtp.* layers draft (method mtp)
_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.")


def stage_layer_range(num_layers: int, stage: int, pp: int) -> tuple[int, int]:
    """[start, end) of the decoder layers pipeline stage ``stage`` of ``pp`` holds; earlier stages
    take the remainder. 10 layers, 4 stages -> (0, 3) (3, 6) (6, 8) (8, 10)."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)


def text_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's fields at the top level: a multimodal wrapper's "text_config" (Qwen3.5)
    lifted out, keeping the wrapper's architectures and its top-level dtype when the text config
    lacks one. The wrapper's tie_word_embeddings, when given, wins over the text config's: HF ties
    the wrapper's lm_head to its language model's embedding by the wrapper's own setting."""
    cfg = dict(hf_config)
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**{k: v for k, v in cfg.items() if not k.endswith("_config")}, **cfg["text_config"]}
        for key in ("architectures", "tie_word_embeddings"):
            if key in hf_config:
                cfg[key] = hf_config[key]
    return cfg


def fp8_weight_block(quant_config: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """(rows, cols) of the tiles of an FP8 block-quantized checkpoint (quant_method "fp8" with
    weight_block_size, as Qwen/Qwen3.5-*-FP8: [128, 128]); None for anything else. The one
    quantization Tengyun loads (tengyun/models/fp8_block.py dequantizes it)."""
    if not isinstance(quant_config, Mapping) or quant_config.get("quant_method") != "fp8":
        return None
    block = quant_config.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        return None
    if quant_config.get("activation_scheme", "dynamic") != "dynamic":
        return None  # static activation scales: input_scale tensors no layer here reads
    return int(block[0]), int(block[1])


def _layer_types(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """config.json's layer_types; a hybrid config without them (Qwen3-Next) has every
    full_attention_interval-th layer full attention (4 when absent, as transformers), the rest
    linear attention; any other model is full attention throughout."""
    layers = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    if cfg.get("linear_num_value_heads"):
        interval = cfg.get("full_attention_interval") or 4
        return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers))
    return (FULL_ATTENTION,) * layers


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) sizes, whole model (not per rank)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int  # linear_conv_kernel_dim

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class MoESpec:
    """Routed experts (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE) and the optional shared expert."""

    num_experts: int  # "num_experts" in Qwen's configs, "num_local_experts" as transformers 5 saves them
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int  # 0: no shared expert


def _moe(cfg: Mapping[str, Any]) -> MoESpec | None:
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return None
    return MoESpec(experts, int(cfg.get("num_experts_per_tok") or 1), int(cfg["moe_intermediate_size"]),
                   int(cfg.get("shared_expert_intermediate_size") or 0))


def _sparse_layers(cfg: Mapping[str, Any], moe: MoESpec | None) -> tuple[bool, ...]:
    """Per layer: an MoE block? Every decoder_sparse_step-th layer outside mlp_only_layers."""
    layers = cfg["num_hidden_layers"]
    if moe is None:
        return (False,) * layers
    step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))


def _linear_attention(cfg: Mapping[str, Any]) -> LinearAttentionSpec | None:
    if not cfg.get("linear_num_value_heads"):
        return None
    return LinearAttentionSpec(cfg["linear_num_key_heads"], cfg["linear_num_value_heads"],
                               cfg["linear_key_head_dim"], cfg["linear_value_head_dim"],
                               cfg.get("linear_conv_kernel_dim", 4))


def mtp_layers_for_speculation(spec: "ModelSpec", folder: Path | None, num_speculative_tokens: int) -> int:
    """The MTP layers --speculative-config method mtp runs: config.json's count, or for a Qwen3-Next
    whose config.json does not say (vLLM then assumes 1) the checkpoint's ``mtp.layers.N`` in
    ``folder``. Raises ValueError naming the flag when there are none or the family has no head."""
    layers = spec.mtp_num_layers
    if not layers and spec.architecture.startswith("Qwen3Next") and folder is not None:
        layers = checkpoint_mtp_layers(folder)
    if not layers:
        raise ValueError(
            f"--speculative-config method mtp needs the model's multi-token-prediction layers, but "
            f"{folder or 'the model'} has none (config.json mtp_num_hidden_layers / num_nextn_predict_layers is 0 "
            f"or missing): use "
            f'{{"method": "ngram", "num_speculative_tokens": {num_speculative_tokens}}} instead.')
    if not spec.architecture.startswith(MTP_ARCHITECTURES):
        raise ValueError(f"--speculative-config method mtp drafts with Qwen3.5's or Qwen3-Next's MTP layers; "
                         f"{spec.architecture} has none Tengyun can run: use method ngram.")
    return layers


def checkpoint_mtp_layers(folder: Path) -> int:
    """Distinct ``mtp.layers.N.`` in a checkpoint's tensor names (model.safetensors.index.json's
    weight_map, else every *.safetensors header): 1 + the largest N, 0 without any."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = list(json.loads(index.read_text()).get("weight_map", {}))
    else:
        names = [name for f in sorted(folder.glob("*.safetensors")) for name in _safetensors_names(f)]
    layers = [int(m.group(1)) for m in map(_MTP_LAYER.match, names) if m]
    return max(layers) + 1 if layers else 0


def _safetensors_names(path: Path) -> list[str]:
    """Tensor names from a .safetensors header (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return [k for k in json.loads(f.read(length)) if k != "__metadata__"]


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # config.json "architectures"[0], or from model_type (GGUF conversions)
    model_type: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int  # whole model; per rank: kv_heads_per_rank(tp)
    head_dim: int
    intermediate_size: int  # dense MLP (0 when every layer is MoE and the config omits it)
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]  # per layer: "full_attention" | "linear_attention"
    sparse_layers: tuple[bool, ...]  # per layer: MLP is an MoE block
    qkv_bias: bool  # bias on q, k and v (Qwen2, or Llama's attention_bias)
    o_bias: bool  # bias on the output projection (attention_bias)
    qk_norm: bool  # RMSNorm per head on q and k before RoPE (Qwen3 and later)
    gated_attention: bool  # q_proj doubled for a sigmoid output gate (Qwen3-Next, Qwen3.5)
    moe: MoESpec | None
    linear_attention: LinearAttentionSpec | None
    # Multi-token-prediction layers in the checkpoint: config.json mtp_num_hidden_layers (Qwen3.5) or
    # num_nextn_predict_layers (Qwen3-Next, as vLLM reads it); EngineConfig counts a Qwen3-Next
    # checkpoint's mtp.layers.N when neither is given.
    mtp_num_layers: int
    checkpoint_dtype: str | None  # config.json torch_dtype / dtype; None when absent
    quantization: str | None  # quantization_config's quant_method; None: unquantised
    fp8_block: tuple[int, int] | None  # FP8 block-quantized weights: tile (rows, cols), dequantized at load
    # The text config (layer_types filled in) for fields only one model reads (rope, mlp_bias, ...);
    # read, never written. A plain dict: specs travel to rank processes pickled.
    hf: Mapping[str, Any] = field(repr=False, compare=False)
    # Layers per pipeline stage, first to last (sizing/pp_layers.py, set by EngineConfig.finalize and
    # `tengyun plan`); None: the even split of stage_layer_range.
    pp_layers: tuple[int, ...] | None = None

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> "ModelSpec":
        cfg = text_config(hf_config)
        heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        model_type = cfg.get("model_type", "")
        moe, layer_types = _moe(cfg), _layer_types(cfg)
        cfg["layer_types"] = list(layer_types)
        archs = cfg.get("architectures") or []
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or hf_config.get("torch_dtype") or hf_config.get("dtype")
        quant = cfg.get("quantization_config") or hf_config.get("quantization_config")
        return cls(
            architecture=archs[0] if archs else MODEL_TYPE_ARCHITECTURES.get(model_type, ""),
            model_type=model_type, hidden_size=hidden, vocab_size=cfg["vocab_size"],
            num_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=int(cfg.get("intermediate_size") or 0), rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            layer_types=layer_types, sparse_layers=_sparse_layers(cfg, moe),
            qkv_bias=model_type in QKV_BIAS_TYPES or bool(cfg.get("attention_bias")),
            o_bias=bool(cfg.get("attention_bias")), qk_norm=model_type in QK_NORM_TYPES,
            gated_attention=model_type in GATED_ATTENTION_TYPES or bool(cfg.get("attn_output_gate")),
            moe=moe, linear_attention=_linear_attention(cfg),
            mtp_num_layers=int(cfg.get("mtp_num_hidden_layers") or cfg.get("num_nextn_predict_layers") or 0),
            checkpoint_dtype=str(dtype) if dtype else None,
            quantization=(quant.get("quant_method") or "unknown") if isinstance(quant, dict) else None,
            fp8_block=fp8_weight_block(quant),
            hf=cfg,
        )

    # ----- layers -----------------------------------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        """Linear-attention layers keep per-sequence recurrent state besides the KV cache."""
        return LINEAR_ATTENTION in self.layer_types

    def layer_is_attention(self, layer: int) -> bool:
        """Does decoder layer ``layer`` keep KV (anything but a linear-attention layer)?"""
        return self.layer_types[layer] != LINEAR_ATTENTION

    def attention_layers(self, start: int = 0, end: int | None = None) -> int:
        """Layers in [start, end) that keep KV."""
        end = self.num_layers if end is None else end
        return sum(self.layer_is_attention(i) for i in range(start, end))

    def stage_layers(self, stage: int, pp: int) -> tuple[int, int]:
        """[start, end) of the layers pipeline stage ``stage`` of ``pp`` holds."""
        if self.pp_layers is not None and len(self.pp_layers) == pp:
            start = sum(self.pp_layers[:stage])
            return start, start + self.pp_layers[stage]
        return stage_layer_range(self.num_layers, stage, pp)

    # ----- tensor parallelism -----------------------------------------------------------------
    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads split over TP ranks; 1 each (replicated) when tp > num_kv_heads."""
        return max(1, self.num_kv_heads // tp)

    def tp_split_fields(self) -> dict[str, int]:
        """config.json fields (other than the attention heads) split evenly over TP ranks: the
        Gated DeltaNet heads, each routed expert's intermediate size (every rank holds a slice of every
        expert; --enable-expert-parallel's whole-expert split is checked by EngineConfig) and the
        shared expert."""
        fields = {"intermediate_size": self.intermediate_size}
        if self.linear_attention:
            fields |= {"linear_num_key_heads": self.linear_attention.num_key_heads,
                       "linear_num_value_heads": self.linear_attention.num_value_heads}
        if self.moe:
            fields |= {"moe_intermediate_size": self.moe.intermediate_size,
                       "shared_expert_intermediate_size": self.moe.shared_intermediate_size}
        return {name: value for name, value in fields.items() if value}

    def tp_sizes(self, limit: int) -> list[int]:
        """Powers of two up to ``limit`` the engine accepts as --tensor-parallel-size: dividing the
        attention heads, with KV heads split or replicated evenly, and tp_split_fields divided."""
        sizes, tp = [], 1
        while tp <= limit:
            if self.tp_problem(tp) is None:
                sizes.append(tp)
            tp *= 2
        return sizes

    def expert_parallel_problem(self, ep: int) -> str | None:
        """Why --enable-expert-parallel cannot divide the experts whole among ``ep`` ranks (the EP
        group: the TP ranks of a stage), or None (also without experts: the flag does nothing there)."""
        if self.moe is None or self.moe.num_experts % ep == 0:
            return None
        experts = self.moe.num_experts
        works = [n for n in range(2, experts + 1) if experts % n == 0]
        return (f"--enable-expert-parallel divides the {experts} experts of each MoE layer whole among the {ep} "
                f"expert-parallel ranks (--tensor-parallel-size {ep}), but {ep} does not divide {experts}: use "
                f"a --tensor-parallel-size among {works}, or drop --enable-expert-parallel.")

    def tp_problem(self, tp: int) -> str | None:
        """Why --tensor-parallel-size ``tp`` cannot split this model, or None."""
        heads, kv = self.num_attention_heads, self.num_kv_heads
        if heads % tp:
            return f"does not divide num_attention_heads {heads}"
        if kv % tp and tp % kv:
            return (f"and num_key_value_heads {kv}: one must divide the other (KV heads are split, or "
                    f"replicated when tp > num_key_value_heads)")
        for name, value in self.tp_split_fields().items():
            if value % tp:
                return f"does not divide {name} {value}"
        return None


def as_spec(config: "ModelSpec | Mapping[str, Any]") -> ModelSpec:
    """A ModelSpec as is, or one built from a config.json dict."""
    return config if isinstance(config, ModelSpec) else ModelSpec.from_hf_config(config)
