"""Which checkpoint modules a LoRA adapter may target, and where Tengyun holds them.

Tengyun fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (the models'
``packed_modules_mapping``); an adapter's q_proj becomes the q slice of qkv_proj:

    q_proj -> self_attn.qkv_proj, shard "q" (slice 0 of 3)
    up_proj -> mlp.gate_up_proj, shard 1 (slice 1 of 2)

The shard id is what the fused layer's ``_out_parts`` takes, so LoRA's B rows are split over
tensor-parallel ranks exactly as the base layer's rows are. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from tengyun.model_spec import ModelSpec

# Architectures whose decoder layers are Llama's (models/llama.py): attention + dense MLP.
LORA_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class Target:
    layer: str  # the Tengyun linear under model.layers.<i>
    shard_id: str | int | None  # the fused layer's shard (its _out_parts), None: not fused
    slice_index: int  # which of the layer's ``num_slices`` rank blocks the adapter's A/B fill
    num_slices: int


TARGETS = {
    "q_proj": Target("self_attn.qkv_proj", "q", 0, 3),
    "k_proj": Target("self_attn.qkv_proj", "k", 1, 3),
    "v_proj": Target("self_attn.qkv_proj", "v", 2, 3),
    "o_proj": Target("self_attn.o_proj", None, 0, 1),
    "gate_proj": Target("mlp.gate_up_proj", 0, 0, 2),
    "up_proj": Target("mlp.gate_up_proj", 1, 1, 2),
    "down_proj": Target("mlp.down_proj", None, 0, 1),
}
SLICES_OF_LAYER = {t.layer: t.num_slices for t in TARGETS.values()}  # "self_attn.qkv_proj" -> 3


def module_shape(spec: ModelSpec, module: str) -> tuple[int, int]:
    """(in, out) features of checkpoint module ``module`` ("k_proj") in the whole model."""
    hidden, head_dim = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * head_dim, spec.num_kv_heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, spec.intermediate_size), "up_proj": (hidden, spec.intermediate_size),
            "down_proj": (spec.intermediate_size, hidden)}[module]


def architecture_problem(spec: ModelSpec) -> str | None:
    """Why LoRA cannot run on this model (None: it can)."""
    if spec.architecture not in LORA_ARCHITECTURES:
        return (f"LoRA adapters run on {', '.join(LORA_ARCHITECTURES)}; this model is {spec.architecture}")
    return None
