"""`tengyun plan`'s arithmetic: will a model fit, and how many sequences of what length, on which cards.

Per card: budget = device memory x --gpu-memory-utilization - weights - activation reserve;
the KV cache takes the budget in blocks of --block-size tokens, each token costing
2 (K, V) x attention layers x KV heads per rank x head dim x dtype bytes (cache.kv_cache_shape, as
the engine's allocator); hybrid models first set aside per-sequence recurrent state for their
linear-attention layers, and with prefix caching snapshot rows of it from what is left
(blocks.cache_capacity, the function the Worker counts its blocks with). Every pipeline stage is
planned; the engine keeps the same block count on every rank, so the smallest stage decides. With
--kv-cache-memory the budget is given, as on CPU. The settings are the engine's own, resolved as
EngineConfig.finalize resolves them (resolve.resolve_sizing).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tengyun.dtypes import DTYPE_BYTES
from tengyun.lora.sizing import lora_slot_bytes
from tengyun.model_spec import ModelSpec, as_spec
from tengyun.quantization.config import QuantConfig
from tengyun.sizing import platform_facts
from tengyun.sizing.blocks import CacheBudget, activation_reserve, cache_capacity
from tengyun.sizing.cache import kv_cache_shape, state_shape
from tengyun.sizing.model_size import StageParams, expert_split, stage_params, total_params
from tengyun.sizing.resolve import ResolvedSizing
from tengyun.sizing.weights import stage_weight_bytes, weight_scale

GiB = 2**30
NO_KV_LAYERS = 2**62  # the block count of a stage without attention layers: it never limits the cache


@dataclass(frozen=True)
class Cards:
    """What a plan needs besides the engine's settings: ``memory`` per card in bytes (None: only a
    --kv-cache-memory budget plans), ``per_node`` cards (TP stays within a node in the search for
    the smallest fit), ``activation_reserve`` bytes (None: blocks.activation_reserve's estimate)."""

    memory: int | None = 64 * GiB
    per_node: int = 8
    activation_reserve: int | None = None


@dataclass(frozen=True)
class StagePlan:
    stage: int
    layers: tuple[int, int]
    params: StageParams
    weight_bytes: int
    budget_bytes: int  # for KV and state; negative: the weights alone do not fit
    attention_layers: int
    kv_heads: int  # per TP rank
    head_dim: int
    kv_bytes_per_token: int
    state_bytes_per_seq: int
    blocks: int
    state_slots: int
    state_snapshots: int = 0  # hybrid prefix caching: snapshot rows of state_bytes_per_seq each
    lora_bytes: int = 0  # --enable-lora: the adapter slots of this stage's layers (lora/sizing.py)


@dataclass
class Plan:
    sizing: ResolvedSizing
    cards: Cards
    model: str
    model_max_len: int
    total_params: int
    activation_bytes: int
    activation_formula: str
    weight_scale: float  # checkpoint bytes / config estimate, when the checkpoint says (quantized, extra tensors)
    stages: list[StagePlan]
    architecture: str = ""
    notes: list[str] = field(default_factory=list)
    checkpoint_bytes: int | None = None  # the loaded tensors as stored (read_model); None: not read
    quantization: str | None = None  # the quantised layers' schemes, counted exactly
    experts: str | None = None  # how a MoE layer's experts lie on a card (model_size.expert_split)

    @property
    def dtype(self) -> str:
        return self.sizing.dtype

    @property
    def kv_cache_dtype(self) -> str:
        return self.sizing.kv_cache_dtype

    @property
    def max_model_len(self) -> int:
        return self.sizing.max_model_len

    @property
    def blocks(self) -> int:
        """Blocks every rank holds (the engine takes the minimum over ranks)."""
        return min(s.blocks for s in self.stages)

    @property
    def cache_tokens(self) -> int:
        return self.blocks * self.sizing.block_size

    @property
    def hybrid(self) -> bool:
        return any(s.state_bytes_per_seq for s in self.stages)

    @property
    def max_concurrency(self) -> int:
        """Sequences of max_model_len tokens that run at once."""
        blocks_per_seq = -(-self.max_model_len // self.sizing.block_size)
        n = min(self.sizing.max_num_seqs, self.blocks // blocks_per_seq)
        if self.hybrid:
            n = min(n, *(s.state_slots for s in self.stages if s.state_bytes_per_seq))
        return max(n, 0)

    @property
    def weights_fit(self) -> bool:
        return all(s.budget_bytes > 0 for s in self.stages)

    @property
    def fits(self) -> bool:
        return self.weights_fit and self.max_concurrency >= 1


def make_plan(config: ModelSpec | dict[str, Any], sizing: ResolvedSizing, cards: Cards | None = None,
              checkpoint_bytes: int | None = None, name: str = "model", quant: QuantConfig | None = None) -> Plan:
    """``sizing``: the engine's settings resolved for the model on sizing.device (resolve_sizing);
    ``cards``: the card planned on (default: 64 GiB, 8 per node);
    ``quant``: the checkpoint's quantisation (checkpoint.read_quantization): its layers count as the
    platform's kernels hold them (packed weights, scales, zeros), not scaled from the files."""
    spec, cards = as_spec(config), cards or Cards()
    if sizing.pp_layers:  # the stages' layers as the engine splits them (pp_layers.py)
        spec = dataclasses.replace(spec, pp_layers=sizing.pp_layers)
    total = total_params(spec)
    scale, notes = (1.0, []) if quant else weight_scale(spec, total, sizing.dtype, checkpoint_bytes, sizing.device)
    if sizing.kv_cache_memory is not None:
        activation, formula = 0, "not taken: --kv-cache-memory is the KV budget itself"
    elif cards.activation_reserve is not None:
        activation, formula = cards.activation_reserve, "--activation-reserve"
    else:
        activation, formula = activation_reserve(spec, sizing)
    stages = [_stage_plan(spec, sizing, cards, stage, scale, activation, quant) for stage in range(sizing.pp)]
    return Plan(sizing, cards, name, spec.max_position_embeddings, total, activation, formula, scale, stages,
                spec.architecture or spec.model_type or "?", notes, checkpoint_bytes,
                quant.describe() if quant else None, expert_split(spec, sizing.tp, sizing.expert_parallel, sizing.dp))


def _stage_plan(spec: ModelSpec, sizing: ResolvedSizing, cards: Cards, stage: int, scale: float, activation: int,
                quant: QuantConfig | None) -> StagePlan:
    """One pipeline stage on one TP rank: its weights, budget, KV blocks and state slots, with the
    functions the engine's worker sizes its caches by."""
    tp, last = sizing.tp, stage == sizing.pp - 1
    params = stage_params(spec, tp, sizing.pp, stage, platform_facts.tied_head_copy(sizing.device, sizing.dtype, tp),
                          sizing.mtp_layers, sizing.pooling, sizing.expert_ranks)
    start, end = params.layers
    weights = stage_weight_bytes(spec, sizing, params, scale, quant)
    shape = kv_cache_shape(spec, DTYPE_BYTES[sizing.kv_cache_dtype], tp, start, end, sizing.mtp_layers if last else 0)
    state = state_shape(spec, DTYPE_BYTES[sizing.dtype], start, end, tp).bytes_per_slot
    lora = 0
    if sizing.lora_slots:
        max_loras, rank, lora_dtype = sizing.lora_slots
        lora = lora_slot_bytes(spec, tp, end - start, max_loras, rank, DTYPE_BYTES[lora_dtype])
    budget = CacheBudget(host_bytes=sizing.kv_cache_memory, device_total=cards.memory, in_use=weights + lora,
                         activation=activation)
    capacity = cache_capacity(sizing, shape, state, spec.is_hybrid, budget)
    return StagePlan(stage, (start, end), params, weights, capacity.budget_bytes, shape.num_layers, shape.num_kv_heads,
                     shape.head_dim, shape.bytes_per_token, state,
                     capacity.blocks if shape.num_layers else NO_KV_LAYERS, capacity.slots, capacity.snapshots, lora)
