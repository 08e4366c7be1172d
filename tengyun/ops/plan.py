"""`tengyun plan`: will a model fit, and how many sequences of what length, on which cards.

Per card: budget = device memory x --gpu-memory-utilization - weights - activation reserve;
the KV cache takes the budget in blocks of --block-size tokens, each token costing
2 (K, V) x attention layers x KV heads per rank x head dim x dtype bytes (kv_sizing, the
function the engine's allocator uses); hybrid models first set aside per-sequence recurrent
state for their linear-attention layers (kv_sizing.split_budget, as the engine does). Every
pipeline stage is planned; the engine keeps the same block count on every rank, so the
smallest stage decides. With --kv-cache-memory the budget is given, as on CPU.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tengyun.config import DTYPE_BYTES
from tengyun.kv_sizing import attention_layer_count, kv_cache_shape, split_budget, state_shape
from tengyun.ops.model_size import (
    GATED_ATTENTION_TYPES, StageParams, decoder_config, head_dim, layer_is_sparse, stage_layer_range,
    stage_params, total_params,
)

GiB, MiB = 2**30, 2**20
MAX_CARDS = 128  # the search for the smallest TP x PP stops here


@dataclass(frozen=True)
class PlanRequest:
    tp: int = 1
    pp: int = 1
    device_memory: int | None = 64 * GiB  # bytes per card
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # KV bytes per card given directly (CPU): no weights/activations taken
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    dtype: str = "auto"  # weights and activations; auto = the checkpoint's
    kv_cache_dtype: str = "auto"  # auto = dtype
    activation_reserve: int | None = None  # None: estimated (activation_estimate)
    devices_per_node: int = 8  # TP stays inside a node when searching the smallest fit


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


@dataclass
class Plan:
    request: PlanRequest
    model: str
    dtype: str
    kv_cache_dtype: str
    max_model_len: int
    model_max_len: int
    total_params: int
    activation_bytes: int
    activation_formula: str
    weight_scale: float  # checkpoint bytes / config estimate, when the checkpoint says (quantized, extra tensors)
    stages: list[StagePlan]
    architecture: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def blocks(self) -> int:
        """Blocks every rank holds (the engine takes the minimum over ranks)."""
        return min(s.blocks for s in self.stages)

    @property
    def cache_tokens(self) -> int:
        return self.blocks * self.request.block_size

    @property
    def hybrid(self) -> bool:
        return any(s.state_bytes_per_seq for s in self.stages)

    @property
    def max_concurrency(self) -> int:
        """Sequences of max_model_len tokens that run at once."""
        blocks_per_seq = -(-self.max_model_len // self.request.block_size)
        n = min(self.request.max_num_seqs, self.blocks // blocks_per_seq)
        if self.hybrid:
            n = min(n, *(s.state_slots for s in self.stages if s.state_bytes_per_seq))
        return max(n, 0)

    @property
    def weights_fit(self) -> bool:
        return all(s.budget_bytes > 0 for s in self.stages)

    @property
    def fits(self) -> bool:
        return self.weights_fit and self.max_concurrency >= 1


# ----- reading the model ------------------------------------------------------------------
def read_model(path: str | Path) -> tuple[dict[str, Any], int | None, str]:
    """MODEL (a HF folder, or a config.json alone) -> (config, checkpoint bytes or None, name).
    Checkpoint bytes come from model.safetensors.index.json's total_size, or the headers of the
    *.safetensors files when there is no index; None when only config.json is there."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: MODEL must be a Hugging Face folder with config.json, "
                                f"or a config.json file.")
    cfg = json.loads(config_path.read_text())
    folder = config_path.parent
    name = folder.name if config_path.name == "config.json" else config_path.stem
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        return cfg, (int(total) if total else None), name
    shards = sorted(folder.glob("*.safetensors"))
    return cfg, (sum(safetensors_bytes(s) for s in shards) if shards else None), name


def safetensors_bytes(path: Path) -> int:
    """Tensor bytes in a .safetensors file, from its JSON header (8-byte length, then JSON)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(end - start for key, meta in header.items() if key != "__metadata__"
               for start, end in [meta["data_offsets"]])


def resolve_dtype(cfg: dict[str, Any], requested: str) -> str:
    if requested != "auto":
        return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                "float": "float32"}.get(requested, requested)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return dtype if dtype in DTYPE_BYTES else "bfloat16"


# ----- the arithmetic ---------------------------------------------------------------------
def activation_estimate(cfg: dict[str, Any], tp: int, tokens: int, max_num_seqs: int,
                        act_bytes: int) -> tuple[int, str]:
    """Peak transient memory of one step, per rank (an estimate; --activation-reserve overrides):
    tokens x (4 x hidden [residual, hidden, normed, attention out] + widest per-rank projection
    output [qkv, gate_up, routed experts' gate_up or linear attention's qkvz]) x dtype bytes,
    plus fp32 logits of every sequence that samples: max_num_seqs x vocab x 4."""
    h, d = cfg["hidden_size"], head_dim(cfg)
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    gated = cfg.get("model_type") in GATED_ATTENTION_TYPES
    widest = heads * d * (2 if gated else 1) // tp + 2 * max(1, kv // tp) * d
    layers = range(cfg["num_hidden_layers"])
    if any(not layer_is_sparse(cfg, i) for i in layers):
        widest = max(widest, 2 * cfg["intermediate_size"] // tp)
    if any(layer_is_sparse(cfg, i) for i in layers):
        routed = cfg.get("num_experts_per_tok", 1) * 2 * cfg["moe_intermediate_size"]
        widest = max(widest, (routed + 2 * (cfg.get("shared_expert_intermediate_size") or 0)) // tp)
    if cfg.get("linear_num_value_heads"):
        qkvz = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"] \
            + 2 * cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
        widest = max(widest, qkvz // tp)
    step = tokens * (4 * h + widest) * act_bytes
    logits = max_num_seqs * cfg["vocab_size"] * 4
    formula = (f"{tokens} tokens x (4 x {h} + {widest}) x {act_bytes} B + "
               f"{max_num_seqs} seqs x {cfg['vocab_size']} vocab x 4 B")
    return step + logits, formula


def _stage_state_bytes(cfg: dict[str, Any], dtype_bytes: int, tp: int, start: int, end: int) -> int:
    """Per-sequence recurrent state of the stage's linear-attention layers on one TP rank
    (kv_sizing.state_shape)."""
    if not cfg.get("linear_num_value_heads"):
        return 0
    return state_shape(cfg, dtype_bytes, start, end, tp).bytes_per_slot


def make_plan(hf_config: dict[str, Any], request: PlanRequest, checkpoint_bytes: int | None = None,
              name: str = "model") -> Plan:
    cfg = decoder_config(hf_config)
    tp, pp, bs = request.tp, request.pp, request.block_size
    if tp < 1 or pp < 1:
        raise ValueError(f"--tensor-parallel-size and --pipeline-parallel-size must be >= 1; got {tp} x {pp}.")
    if pp > cfg["num_hidden_layers"]:
        raise ValueError(f"--pipeline-parallel-size {pp} is more than num_hidden_layers "
                         f"{cfg['num_hidden_layers']}: use at most {cfg['num_hidden_layers']}.")
    dtype = resolve_dtype(cfg, request.dtype)
    kv_dtype = dtype if request.kv_cache_dtype == "auto" else resolve_dtype(cfg, request.kv_cache_dtype)
    model_max = int(cfg.get("max_position_embeddings") or 2048)
    max_len = request.max_model_len or model_max
    total = total_params(cfg)
    notes: list[str] = []
    scale = 1.0
    estimate = total * DTYPE_BYTES[dtype]
    if checkpoint_bytes and abs(checkpoint_bytes / estimate - 1) > 0.02:
        scale = checkpoint_bytes / estimate
        notes.append(f"The checkpoint holds {checkpoint_bytes / GiB:.2f} GiB but config.json's decoder is "
                     f"{estimate / GiB:.2f} GiB in {dtype} (quantized weights, or vision / MTP tensors): "
                     f"weights per card scaled by {scale:.3f}.")
    if cfg.get("quantization_config") and not checkpoint_bytes:
        notes.append(f"config.json has a quantization_config but no checkpoint files are here: weights are "
                     f"counted as {dtype}; plan the folder with its *.safetensors (or index) for real sizes.")
    if max_len > model_max:
        notes.append(f"--max-model-len {max_len} is longer than max_position_embeddings {model_max}: "
                     f"the engine refuses it; lower it to {model_max}.")
    if request.kv_cache_memory is not None:
        activation, formula = 0, "not taken: --kv-cache-memory is the KV budget itself"
    elif request.activation_reserve is not None:
        activation, formula = request.activation_reserve, "--activation-reserve"
    else:
        activation, formula = activation_estimate(cfg, tp, request.max_num_batched_tokens, request.max_num_seqs,
                                                  DTYPE_BYTES[dtype])
    stages = []
    for stage in range(pp):
        start, end = stage_layer_range(cfg["num_hidden_layers"], stage, pp)
        params = stage_params(cfg, tp, pp, stage, (start, end))
        weights = int(params.total * DTYPE_BYTES[dtype] * scale)
        if request.kv_cache_memory is not None:
            budget = request.kv_cache_memory
        else:
            if request.device_memory is None:
                raise ValueError("--device-memory is needed (e.g. 64GiB for an Ascend 910B), "
                                 "or --kv-cache-memory to give the KV budget directly.")
            budget = int(request.device_memory * request.gpu_memory_utilization) - weights - activation
        attention = attention_layer_count(cfg, start, end)
        shape = dataclasses.replace(kv_cache_shape(cfg, DTYPE_BYTES[kv_dtype], tp), num_layers=attention)
        state = _stage_state_bytes(cfg, DTYPE_BYTES[dtype], tp, start, end)
        if attention == 0:  # no KV on this stage: it never limits the block count
            blocks, slots = (2**62, max(1, min(request.max_num_seqs, max(budget, 0) // state)) if state else 0)
        else:
            blocks, slots = split_budget(max(budget, 0), bs, shape, state, request.max_num_seqs, max_len)
        stages.append(StagePlan(stage, (start, end), params, weights, budget, attention, shape.num_kv_heads,
                                shape.head_dim, shape.bytes_per_token, state, blocks, slots))
    architecture = (hf_config.get("architectures") or [cfg.get("model_type", "?")])[0]
    return Plan(request, name, dtype, kv_dtype, max_len, model_max, total, activation, formula, scale,
                stages, architecture, notes)


def tp_candidates(cfg: dict[str, Any], limit: int) -> list[int]:
    """TP sizes the engine accepts: powers of two dividing the attention heads, with KV heads
    split or replicated evenly, and the linear-attention heads and experts split evenly."""
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    # Split evenly too (EngineConfig._check_tp_divides): Gated DeltaNet heads, experts, shared expert.
    split = [cfg.get(f) for f in ("linear_num_key_heads", "linear_num_value_heads", "num_experts",
                                  "shared_expert_intermediate_size") if cfg.get(f)]
    sizes, tp = [], 1
    while tp <= limit:
        if heads % tp == 0 and (kv % tp == 0 or tp % kv == 0) and all(n % tp == 0 for n in split):
            sizes.append(tp)
        tp *= 2
    return sizes


def smallest_fit(hf_config: dict[str, Any], request: PlanRequest, checkpoint_bytes: int | None = None
                 ) -> tuple[int, int] | None:
    """The (tp, pp) with the fewest cards that fits max_model_len (ties: fewer pipeline stages);
    TP stays within --devices-per-node."""
    cfg = decoder_config(hf_config)
    candidates = [(tp, pp) for tp in tp_candidates(cfg, request.devices_per_node)
                  for pp in range(1, cfg["num_hidden_layers"] + 1) if tp * pp <= MAX_CARDS]
    for tp, pp in sorted(candidates, key=lambda c: (c[0] * c[1], c[1])):
        if make_plan(hf_config, dataclasses.replace(request, tp=tp, pp=pp), checkpoint_bytes).fits:
            return tp, pp
    return None


# ----- the report ---------------------------------------------------------------------------
def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


def worst_stage(plan: Plan) -> StagePlan:
    return min(plan.stages, key=lambda s: (s.blocks, s.budget_bytes))


def report_lines(plan: Plan, fit: tuple[int, int] | None) -> list[str]:
    r, s = plan.request, worst_stage(plan)
    cfg_line = (f"Model {plan.model} ({plan.architecture}): {plan.total_params:,} decoder parameters, "
                f"weights {plan.dtype}, KV cache {plan.kv_cache_dtype}")
    lines = [cfg_line, f"Plan: TP {r.tp} x PP {r.pp} = {r.tp * r.pp} card(s); showing stage {s.stage} "
                       f"(layers {s.layers[0]}-{s.layers[1] - 1}), the one that holds the fewest KV blocks", ""]
    p = s.params
    lines.append(f"Weights per card: {p.total:,} params x {DTYPE_BYTES[plan.dtype]} B"
                 + (f" x {plan.weight_scale:.3f}" if plan.weight_scale != 1.0 else "")
                 + f" = {_size(s.weight_bytes)}")
    lines.append(f"  embedding {p.embedding:,} + attention {p.attention:,} + linear attention "
                 f"{p.linear_attention:,} + MLP/MoE {p.mlp:,} + norms {p.norms:,} + LM head {p.lm_head:,}")
    if r.kv_cache_memory is not None:
        lines.append(f"KV budget per card: --kv-cache-memory = {_size(s.budget_bytes)} ({s.budget_bytes:,} B)")
    else:
        lines.append(f"Activation reserve: {plan.activation_formula} = {_size(plan.activation_bytes)}")
        lines.append(f"KV budget per card: {_size(r.device_memory)} x {r.gpu_memory_utilization} - "
                     f"{_size(s.weight_bytes)} weights - {_size(plan.activation_bytes)} activations = "
                     f"{_size(s.budget_bytes)} ({s.budget_bytes:,} B)")
    lines.append(f"KV bytes per token per card: 2 (K, V) x {s.attention_layers} attention layers x "
                 f"{s.kv_heads} KV heads x {s.head_dim} head dim x {DTYPE_BYTES[plan.kv_cache_dtype]} B = "
                 f"{s.kv_bytes_per_token:,} B")
    if s.state_bytes_per_seq:
        lines.append(f"Recurrent state per sequence per card ({s.layers[1] - s.layers[0] - s.attention_layers} "
                     f"linear-attention layers): {s.state_bytes_per_seq:,} B; {s.state_slots} slots set aside "
                     f"= {_size(s.state_slots * s.state_bytes_per_seq)}")
    if not plan.weights_fit:
        lines.append(f"Does not fit: the weights and activations alone exceed the budget by "
                     f"{_size(-s.budget_bytes)} per card.")
    else:
        lines.append(f"KV cache: {plan.blocks:,} blocks x {r.block_size} tokens = {plan.cache_tokens:,} tokens "
                     f"({s.kv_bytes_per_token * r.block_size:,} B per block)")
        blocks_per_seq = -(-plan.max_model_len // r.block_size)
        lines.append(f"Max concurrent sequences at {plan.max_model_len:,} tokens: min(--max-num-seqs "
                     f"{r.max_num_seqs}, {plan.blocks:,} // {blocks_per_seq:,} blocks"
                     + (", state slots" if plan.hybrid else "") + f") = {plan.max_concurrency}")
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(f"--max-model-len {plan.max_model_len:,} {verdict}" + (
        "" if plan.fits or not plan.weights_fit else
        f": the cache holds {plan.cache_tokens:,} tokens; lower --max-model-len to {plan.cache_tokens:,} "
        f"or add cards"))
    lines.append("Smallest TP x PP that fits: " + (f"{fit[0]} x {fit[1]} = {fit[0] * fit[1]} card(s)" if fit
                                                  else f"none up to {MAX_CARDS} cards"))
    lines.extend(f"Note: {n}" for n in plan.notes)
    return lines


def plan_json(plan: Plan, fit: tuple[int, int] | None) -> dict[str, Any]:
    r = plan.request
    return {
        "model": plan.model, "architecture": plan.architecture, "total_params": plan.total_params, "dtype": plan.dtype,
        "kv_cache_dtype": plan.kv_cache_dtype, "tensor_parallel_size": r.tp, "pipeline_parallel_size": r.pp,
        "device_memory": r.device_memory, "gpu_memory_utilization": r.gpu_memory_utilization,
        "kv_cache_memory": r.kv_cache_memory, "block_size": r.block_size, "max_model_len": plan.max_model_len,
        "activation_bytes": plan.activation_bytes, "weight_scale": plan.weight_scale,
        "stages": [{
            "stage": s.stage, "layers": list(s.layers),
            "params": dataclasses.asdict(s.params) | {"total": s.params.total},
            "weight_bytes": s.weight_bytes, "budget_bytes": s.budget_bytes, "attention_layers": s.attention_layers,
            "kv_bytes_per_token": s.kv_bytes_per_token, "state_bytes_per_seq": s.state_bytes_per_seq,
            "blocks": s.blocks if s.attention_layers else None, "state_slots": s.state_slots,
        } for s in plan.stages],
        "blocks": plan.blocks, "cache_tokens": plan.cache_tokens, "max_concurrency": plan.max_concurrency,
        "fits": plan.fits, "smallest_fit": list(fit) if fit else None, "notes": plan.notes,
    }

