"""Give each linear layer the quantisation scheme its checkpoint tensors are stored in.

Called once on a freshly built model, before its weights load: a layer whose checkpoint module
(config.json's targets and ignore list, matched against checkpoint names) is quantised swaps its
dense ``weight`` for the scheme's tensors (LinearBase.use_quant_scheme). The worker builds the
model inside ``deferred_weights()``, so those dense weights were only ever meta tensors; the
layers left unquantised get real storage here. Fused layers match
through the model's packed_modules_mapping: qkv_proj is quantised when q_proj, k_proj and
v_proj are, all with one scheme (or, where the format allows a mix: a GGUF, each with its own, as
the layer's shards: LinearBase.use_shard_schemes); stacked MoE experts (FusedMoE) when expert 0's
projections are.
Where the format stores them quantised too (QuantConfig.vocab_layers: GGUF), the embedding and LM
head take their scheme's tensors (embed_head.py); a tied head shares its embedding's. An untied
LM head a compressed-tensors checkpoint targets by name (QuantConfig.head_scheme) takes its
scheme's tensors too.
"""

from __future__ import annotations

import torch
from torch import nn

from tengyun.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from tengyun.layers.fused_moe import FusedMoE
from tengyun.layers.linear import LinearBase
from tengyun.layers.weight_loading import materialize
from tengyun.quantization.config import QuantConfig, QuantizationError
from tengyun.quantization.scheme import LinearScheme


def checkpoint_modules(model: nn.Module, name: str, module: nn.Module | None = None) -> list[str]:
    """A layer's name -> the checkpoint modules stored for it:
    model.layers.0.self_attn.qkv_proj -> [...q_proj, ...k_proj, ...v_proj]; the stacked experts
    model.layers.0.mlp.experts -> expert 0's [...experts.0.gate_proj, ...up_proj, ...down_proj]
    (every expert takes expert 0's scheme; gate and up one, down its own: FusedMoE's w13 and w2);
    a part of a checkpoint module the model splits: the model's ``quant_stored_as``
    (Qwen3-Next's linear_attn.in_proj_qkv -> [...linear_attn.in_proj_qkvz])."""
    if isinstance(module, FusedMoE):
        return [f"{name}.0.{proj}" for proj in ("gate_proj", "up_proj", "down_proj")]
    prefix, _, last = name.rpartition(".")
    stored_as = getattr(model, "quant_stored_as", {}).get(last)  # a module the checkpoint fuses (Qwen3-Next)
    if stored_as:
        return [f"{prefix}.{stored_as}"]
    shards = getattr(model, "packed_modules_mapping", {}).get(last)
    return [f"{prefix}.{shard}" if prefix else shard for shard in shards] if shards else [name]


def apply_quant_config(model: nn.Module, quant: QuantConfig | None, device: torch.device) -> tuple[LinearScheme, ...]:
    """Every linear layer and MoE block of ``model`` (built inside deferred_weights(): their
    tensors on the meta device) takes its scheme's tensors, or its dense ones, on ``device``.
    -> the schemes the model's layers now hold (what the platform picks kernels for)."""
    used: set[LinearScheme] = set()
    for name, module in list(model.named_modules()):  # a list: a mixed fused layer adds its shards
        if isinstance(module, VocabParallelEmbedding):
            if quant is not None and (quant.vocab_layers or quant.named_head):
                scheme = _vocab_scheme(model, name, module, quant)
                if scheme is not None:
                    module.use_quant_scheme(scheme, name, device)
                    used.add(scheme)  # the platform's kernel: the head's matmul, the embedding's rows
            continue
        if not isinstance(module, (LinearBase, FusedMoE)):
            continue
        if quant is not None and isinstance(module, FusedMoE):
            stacks = _expert_schemes(model, name, module, quant)
            if any(stacks.values()):
                module.use_quant_scheme(stacks, name, device)
                used.update(s for s in stacks.values() if s is not None)
        elif quant is not None and (schemes := _mixed_shard_schemes(model, name, module, quant)):
            module.use_shard_schemes(schemes, name, device)
            used.update(s for s in schemes if s is not None)
        elif quant is not None:
            scheme = _scheme_of(model, name, module, quant)
            if scheme is not None:
                module.use_quant_scheme(scheme, name, device)
                used.add(scheme)
        materialize(module, device)
    if quant is not None and not used:
        raise QuantizationError(f"config.json's quantization_config ({quant.method}) targets none of this "
                                f"model's linear layers: check its config_groups targets and ignore list.")
    return tuple(sorted(used, key=lambda s: s.description))


def _vocab_scheme(model: nn.Module, name: str, module: VocabParallelEmbedding,
                  quant: QuantConfig) -> LinearScheme | None:
    """The embedding's stored scheme; a tied head's is its embedding's (a tied checkpoint stores
    the embedding only), also on a last pipeline stage that holds the head without the embedding.
    Formats that quantise linear layers only: an untied head's, where a target names it."""
    if not quant.vocab_layers:
        tied = getattr(model, "tie_word_embeddings", False) or getattr(module, "tied_embedding", None)
        return quant.head_scheme(name) if isinstance(module, ParallelLMHead) and not tied else None
    if isinstance(module, ParallelLMHead) and module.tied_embedding:
        return module.tied_embedding[0].scheme
    if isinstance(module, ParallelLMHead) and getattr(model, "tie_word_embeddings", False):
        return quant.scheme_for(name.removesuffix("lm_head") + "model.embed_tokens")
    return quant.scheme_for(name)


def _expert_schemes(model: nn.Module, name: str, module: FusedMoE,
                    quant: QuantConfig) -> dict[str, LinearScheme | None]:
    """{"w13": gate and up's scheme (one: they stack), "w2": down's} of expert 0."""
    gate, up, down = checkpoint_modules(model, name, module)
    return {"w13": _scheme_of(model, name, module, quant, (gate, up)), "w2": quant.scheme_for(down)}


def _mixed_shard_schemes(model: nn.Module, name: str, module: LinearBase,
                         quant: QuantConfig) -> list[LinearScheme | None] | None:
    """Each checkpoint module's scheme where this fused layer holds them in different schemes, as
    its format allows (QuantConfig.mixed_shards); else None."""
    if not quant.mixed_shards:
        return None
    schemes = [quant.scheme_for(part) for part in checkpoint_modules(model, name, module)]
    return schemes if len(set(schemes)) > 1 else None


def _scheme_of(model: nn.Module, name: str, module: nn.Module, quant: QuantConfig,
               stored: tuple[str, ...] | None = None) -> LinearScheme | None:
    stored = stored or checkpoint_modules(model, name, module)
    schemes = {quant.scheme_for(part) for part in stored}
    if len(schemes) > 1:
        raise QuantizationError(
            f"{', '.join(stored)} are quantised differently ({quant.method} config_groups / ignore), but "
            f"Tengyun runs them as one layer {name}: give them one scheme, or ignore all of them.")
    return schemes.pop()
