"""`tengyun plan`'s report: the smallest TP x PP that fits, and the arithmetic as text or JSON.
The arithmetic itself is tengyun/sizing/plan.py, with the settings resolved as the engine resolves
them (sizing/resolve.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tengyun.dtypes import DTYPE_BYTES
from tengyun.model_spec import ModelSpec, as_spec
from tengyun.quantization.config import QuantConfig
from tengyun.sizing.plan import Cards, Plan, StagePlan, make_plan
from tengyun.sizing.pp_layers import balanced_partition
from tengyun.sizing.resolve import ResolvedSizing

GiB, MiB = 2**30, 2**20
MAX_CARDS = 128  # the search for the smallest TP x PP stops here


def tp_candidates(config: ModelSpec | dict[str, Any], limit: int) -> list[int]:
    """TP sizes the engine accepts: powers of two dividing the attention heads, with KV heads
    split or replicated evenly, and the linear-attention heads and experts split evenly."""
    return as_spec(config).tp_sizes(limit)


def smallest_fit(config: ModelSpec | dict[str, Any], sizing: ResolvedSizing, cards: Cards | None = None,
                 checkpoint_bytes: int | None = None, quant: QuantConfig | None = None) -> tuple[int, int] | None:
    """The (tp, pp) with the fewest cards that fits max_model_len (ties: fewer pipeline stages);
    TP stays within --devices-per-node."""
    spec, cards = as_spec(config), cards or Cards()
    candidates = [(tp, pp) for tp in spec.tp_sizes(cards.per_node)
                  for pp in range(1, spec.num_layers + 1) if tp * pp <= MAX_CARDS]
    for tp, pp in sorted(candidates, key=lambda c: (c[0] * c[1], c[1])):
        # the stages as the engine would split them at that pp (the user's partition is for sizing.pp only)
        layers = sizing.pp_layers if pp == sizing.pp else balanced_partition(spec, pp) if pp > 1 else None
        tried = dataclasses.replace(sizing, tp=tp, pp=pp, pp_layers=layers)
        if make_plan(spec, tried, cards, checkpoint_bytes, quant=quant).fits:
            return tp, pp
    return None


# ----- the report ---------------------------------------------------------------------------
def layout_name(r: ResolvedSizing) -> str:
    """"TP 8 x PP 4", or with data parallelism "DP 4 x TP 8 x PP 1 (EP 32)"."""
    if r.dp == 1:
        return f"TP {r.tp} x PP {r.pp}"
    return f"DP {r.dp} x TP {r.tp} x PP {r.pp}" + (f" (EP {r.expert_ranks})" if r.expert_parallel else "")


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


def worst_stage(plan: Plan) -> StagePlan:
    return min(plan.stages, key=lambda s: (s.blocks, s.budget_bytes))


def _budget_lines(plan: Plan, s: StagePlan) -> list[str]:
    """The LoRA slots (with --enable-lora) and how the KV budget of stage ``s`` is made."""
    r, lines = plan.sizing, []
    if s.lora_bytes:
        max_loras, rank, lora_dtype = r.lora_slots
        lines.append(f"LoRA slots per card: --max-loras {max_loras} x --max-lora-rank {rank} in {lora_dtype} over "
                     f"{s.layers[1] - s.layers[0]} layers' q/k/v/o and gate/up/down = {_size(s.lora_bytes)}")
    if r.kv_cache_memory is not None:
        return lines + [f"KV budget per card: --kv-cache-memory = {_size(s.budget_bytes)} ({s.budget_bytes:,} B)"]
    return lines + [
        f"Activation reserve: {plan.activation_formula} = {_size(plan.activation_bytes)}",
        f"KV budget per card: {_size(plan.cards.memory)} x {r.gpu_memory_utilization} - "
        f"{_size(s.weight_bytes)} weights - "
        + (f"{_size(s.lora_bytes)} LoRA slots - " if s.lora_bytes else "")
        + f"{_size(plan.activation_bytes)} activations = {_size(s.budget_bytes)} ({s.budget_bytes:,} B)"]


def report_lines(plan: Plan, fit: tuple[int, int] | None) -> list[str]:
    r, s = plan.sizing, worst_stage(plan)
    cfg_line = (f"Model {plan.model} ({plan.architecture}): {plan.total_params:,} decoder parameters, "
                f"weights {plan.dtype}, KV cache {plan.kv_cache_dtype}, on {r.device}")
    lines = [cfg_line, f"Plan: {layout_name(r)} = {r.dp * r.tp * r.pp} card(s); showing stage {s.stage} "
                       f"(layers {s.layers[0]}-{s.layers[1] - 1}), the one that holds the fewest KV blocks"]
    if r.pp > 1:
        lines.append("Layers per stage: " + " / ".join(str(st.layers[1] - st.layers[0]) for st in plan.stages)
                     + " (balanced by the weights a decode step reads, the LM head on the last stage; "
                       "VLLM_PP_LAYER_PARTITION sets them)")
    lines.append("")
    p = s.params
    lines.append(f"Weights per card: {p.total:,} params x {DTYPE_BYTES[plan.dtype]} B"
                 + (f" x {plan.weight_scale:.3f}" if plan.weight_scale != 1.0 else "")
                 + f" = {_size(s.weight_bytes)}"
                 + (f" with the quantised linear layers as their kernels hold them ({plan.quantization})"
                    if plan.quantization else ""))
    lines.append(f"  embedding {p.embedding:,} + attention {p.attention:,} + linear attention "
                 f"{p.linear_attention:,} + MLP/MoE {p.mlp:,} + norms {p.norms:,} + LM head {p.lm_head:,}"
                 + (f" + MTP head {p.mtp:,}" if p.mtp else ""))
    if plan.experts:
        lines.append(f"  MoE experts per card: {plan.experts}")
    lines += _budget_lines(plan, s)
    mtp_kv = r.mtp_layers if s.stage == r.pp - 1 else 0
    lines.append(f"KV bytes per token per card: 2 (K, V) x {s.attention_layers} attention layers"
                 + (f" ({mtp_kv} of the MTP head)" if mtp_kv else "") + " x "
                 f"{s.kv_heads} KV heads x {s.head_dim} head dim x {DTYPE_BYTES[plan.kv_cache_dtype]} B = "
                 f"{s.kv_bytes_per_token:,} B")
    if s.state_bytes_per_seq:
        linear_layers = s.layers[1] - s.layers[0] - (s.attention_layers - mtp_kv)
        lines.append(f"Recurrent state per sequence per card ({linear_layers} "
                     f"linear-attention layers): {s.state_bytes_per_seq:,} B; {s.state_slots} slots + "
                     f"{s.state_snapshots} prefix-cache snapshots set aside "
                     f"= {_size((s.state_slots + s.state_snapshots) * s.state_bytes_per_seq)}")
    if not plan.weights_fit:
        lines.append(f"Does not fit: the weights and activations alone exceed the budget by "
                     f"{_size(-s.budget_bytes)} per card.")
    else:
        lines.append(f"KV cache: {plan.blocks:,} blocks x {r.block_size} tokens = {plan.cache_tokens:,} tokens "
                     f"({s.kv_bytes_per_token * r.block_size:,} B per block)")
        blocks_per_seq = -(-plan.max_model_len // r.block_size)
        lines.append(f"Max concurrent sequences at {plan.max_model_len:,} tokens: min(--max-num-seqs "
                     f"{r.max_num_seqs}, {plan.blocks:,} // {blocks_per_seq:,} blocks"
                     + (", state slots" if plan.hybrid else "") + f") = {plan.max_concurrency}"
                     + (f" per replica; {r.dp} replicas: {r.dp * plan.max_concurrency:,} in all" if r.dp > 1 else ""))
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(f"--max-model-len {plan.max_model_len:,} {verdict}" + (
        "" if plan.fits or not plan.weights_fit else
        f": the cache holds {plan.cache_tokens:,} tokens; lower --max-model-len to {plan.cache_tokens:,} "
        f"or add cards"))
    per_replica = f" per replica (DP {r.dp})" if r.dp > 1 else ""
    lines.append(f"Smallest TP x PP{per_replica} that fits: "
                 + (f"{fit[0]} x {fit[1]} = {fit[0] * fit[1]} card(s)" if fit else f"none up to {MAX_CARDS} cards"))
    lines.extend(f"Note: {n}" for n in plan.notes)
    return lines


def plan_json(plan: Plan, fit: tuple[int, int] | None) -> dict[str, Any]:
    r = plan.sizing
    return {
        "model": plan.model, "architecture": plan.architecture, "total_params": plan.total_params, "dtype": plan.dtype,
        "kv_cache_dtype": plan.kv_cache_dtype, "device": r.device, "tensor_parallel_size": r.tp,
        "pipeline_parallel_size": r.pp, "data_parallel_size": r.dp, "expert_parallel_size":
            r.expert_ranks if r.expert_parallel else None,
        "device_memory": plan.cards.memory, "gpu_memory_utilization": r.gpu_memory_utilization,
        "kv_cache_memory": r.kv_cache_memory, "block_size": r.block_size, "max_model_len": plan.max_model_len,
        "activation_bytes": plan.activation_bytes, "weight_scale": plan.weight_scale,
        "checkpoint_bytes": plan.checkpoint_bytes,
        "quantization": plan.quantization, "expert_parallel": r.expert_parallel, "experts": plan.experts,
        "stages": [{
            "stage": s.stage, "layers": list(s.layers),
            "params": dataclasses.asdict(s.params) | {"total": s.params.total},
            "weight_bytes": s.weight_bytes, "budget_bytes": s.budget_bytes, "attention_layers": s.attention_layers,
            "kv_bytes_per_token": s.kv_bytes_per_token, "state_bytes_per_seq": s.state_bytes_per_seq,
            "blocks": s.blocks if s.attention_layers else None, "state_slots": s.state_slots,
            "lora_bytes": s.lora_bytes,
            "state_snapshots": s.state_snapshots,
        } for s in plan.stages],
        "blocks": plan.blocks, "cache_tokens": plan.cache_tokens, "max_concurrency": plan.max_concurrency,
        "max_concurrency_all_replicas": r.dp * plan.max_concurrency,
        "fits": plan.fits, "smallest_fit": list(fit) if fit else None, "notes": plan.notes,
    }

