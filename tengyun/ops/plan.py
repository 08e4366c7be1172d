"""`tengyun plan`: will a model fit, and how many sequences of what length, on which cards.

Per card: budget = device memory x --gpu-memory-utilization - weights - activation reserve;
the KV cache takes the budget in blocks of --block-size tokens, each token costing
2 (K, V) x attention layers x KV heads per rank x head dim x dtype bytes (kv_sizing, the
function the engine's allocator uses); hybrid models first set aside per-sequence recurrent
state for their linear-attention layers, and with prefix caching snapshot rows of it from what
is left (kv_sizing.split_budget, as the engine does). Every
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

from tengyun.sizing.cache import activation_estimate, kv_cache_shape, split_budget, state_shape
from tengyun.model_spec import DTYPE_BYTES, UNLOADED_CHECKPOINT_PREFIXES, ModelSpec, as_spec, canonical_dtype
from tengyun.sizing.model_size import StageParams, decoder_linears, stage_params, total_params
from tengyun.quantization.config import QuantConfig, detect_quantization

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
    dtype: str = "auto"  # weights and activations; auto = what the engine serves on `device` (platforms.served_dtype)
    kv_cache_dtype: str = "auto"  # auto = dtype
    device: str = "npu"  # the platform planned for: cpu, cuda or npu
    activation_reserve: int | None = None  # None: estimated (activation_estimate)
    devices_per_node: int = 8  # TP stays inside a node when searching the smallest fit
    enable_prefix_caching: bool = True  # hybrid models keep recurrent-state snapshots for it
    # --speculative-config method mtp: the MTP head's layers (mtp_layers_for_speculation), whose
    # weights and KV the last stage holds; 0 without it.
    mtp_layers: int = 0


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
    checkpoint_bytes: int | None = None  # the loaded tensors as stored (read_model); None: not read
    quantization: str | None = None  # the quantised layers' schemes, counted exactly

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
    Checkpoint bytes are those of the tensors the engine loads, from the *.safetensors headers
    (a vision tower and MTP layers, UNLOADED_CHECKPOINT_PREFIXES, left out); without the shards,
    model.safetensors.index.json's total_size (all tensors); None when only config.json is there."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: MODEL must be a Hugging Face folder with config.json, "
                                f"or a config.json file.")
    cfg = json.loads(config_path.read_text())
    folder = config_path.parent
    name = folder.name if config_path.name == "config.json" else config_path.stem
    index = folder / "model.safetensors.index.json"
    index_json = json.loads(index.read_text()) if index.is_file() else None
    shards = ([folder / f for f in sorted(set(index_json.get("weight_map", {}).values()))] if index_json
              else sorted(folder.glob("*.safetensors")))
    if shards and all(s.is_file() for s in shards):
        return cfg, sum(safetensors_bytes(s, tuple(UNLOADED_CHECKPOINT_PREFIXES)) for s in shards), name
    total = (index_json or {}).get("metadata", {}).get("total_size")
    return cfg, (int(total) if total else None), name


def read_quantization(path: str | Path, hf_config: dict[str, Any], forced: str | None = None) -> QuantConfig | None:
    """The checkpoint's quantisation as the engine reads it (config.json, --quantization ``forced``)."""
    path = Path(path)
    return detect_quantization(hf_config, forced, path if path.is_dir() else path.parent)


def safetensors_bytes(path: Path, skip: tuple[str, ...] = ()) -> int:
    """Tensor bytes in a .safetensors file, from its JSON header (8-byte length, then JSON), less
    the tensors whose names start with one of ``skip``."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(end - start for key, meta in header.items() if key != "__metadata__" and not key.startswith(skip)
               for start, end in [meta["data_offsets"]])


# ----- the arithmetic ---------------------------------------------------------------------
def make_plan(config: ModelSpec | dict[str, Any], request: PlanRequest, checkpoint_bytes: int | None = None,
              name: str = "model", quant: QuantConfig | None = None) -> Plan:
    """``quant``: the checkpoint's quantisation (read_quantization): its layers count as the
    platform's kernels hold them (packed weights, scales, zeros), not scaled from the files."""
    spec = as_spec(config)
    tp, pp = request.tp, request.pp
    if tp < 1 or pp < 1:
        raise ValueError(f"--tensor-parallel-size and --pipeline-parallel-size must be >= 1; got {tp} x {pp}.")
    if pp > spec.num_layers:
        raise ValueError(f"--pipeline-parallel-size {pp} is more than num_hidden_layers "
                         f"{spec.num_layers}: use at most {spec.num_layers}.")
    from tengyun.platforms import served_dtype

    dtype = served_dtype(request.dtype, request.device, spec.checkpoint_dtype)
    kv_dtype = dtype if request.kv_cache_dtype == "auto" else canonical_dtype(request.kv_cache_dtype)
    max_len = request.max_model_len or spec.max_position_embeddings
    total = total_params(spec)
    scale, notes = (1.0, []) if quant else _weight_scale(spec, total, dtype, checkpoint_bytes, request.device)
    if max_len > spec.max_position_embeddings:
        notes.append(f"--max-model-len {max_len} is longer than max_position_embeddings "
                     f"{spec.max_position_embeddings}: the engine refuses it; lower it to "
                     f"{spec.max_position_embeddings}.")
    if request.kv_cache_memory is not None:
        activation, formula = 0, "not taken: --kv-cache-memory is the KV budget itself"
    elif request.activation_reserve is not None:
        activation, formula = request.activation_reserve, "--activation-reserve"
    else:
        activation, formula = activation_estimate(spec, tp, request.max_num_batched_tokens, request.max_num_seqs,
                                                  DTYPE_BYTES[dtype])
    stages = [_stage_plan(spec, request, stage, dtype, kv_dtype, scale, activation, max_len, quant)
              for stage in range(pp)]
    return Plan(request, name, dtype, kv_dtype, max_len, spec.max_position_embeddings, total, activation, formula,
                scale, stages, spec.architecture or spec.model_type or "?", notes, checkpoint_bytes,
                quant.describe() if quant else None)


def _weight_scale(spec: ModelSpec, params: int, dtype: str, checkpoint_bytes: int | None,
                  device: str) -> tuple[float, list[str]]:
    """(checkpoint bytes / config estimate, notes): weights follow the checkpoint's own size when it
    differs by more than 2 % from ``params`` in the checkpoint's dtype (quantized weights); a float32
    checkpoint served in bfloat16 is not scaled, nor an FP8 block-quantized one dequantized at load."""
    from tengyun.platforms import platform_class

    if spec.fp8_block and not platform_class(device).fp8_matmul:
        held = (f"it holds {checkpoint_bytes / GiB:.2f} GiB as stored (FP8 weights, their scales and the "
                f"unquantized tensors); " if checkpoint_bytes else "")
        return 1.0, [f"FP8 block-quantized checkpoint (weight_block_size {list(spec.fp8_block)}): {held}{device} has "
                     f"no FP8 matmul, so the engine dequantizes it at load and its weights count in {dtype}: "
                     f"{params * DTYPE_BYTES[dtype] / GiB:.2f} GiB."]
    notes: list[str] = []
    scale = 1.0
    stored = spec.checkpoint_dtype if spec.checkpoint_dtype in DTYPE_BYTES else dtype
    estimate = params * DTYPE_BYTES[stored]
    if checkpoint_bytes and abs(checkpoint_bytes / estimate - 1) > 0.02:
        scale = checkpoint_bytes / estimate
        notes.append(f"The checkpoint holds {checkpoint_bytes / GiB:.2f} GiB but config.json's decoder is "
                     f"{estimate / GiB:.2f} GiB in {stored} (quantized weights, or tensors the decoder does not "
                     f"have): weights per card scaled by {scale:.3f}.")
    if spec.quantization and not checkpoint_bytes:
        notes.append(f"config.json has a quantization_config but no checkpoint files are here: weights are "
                     f"counted as {dtype}; plan the folder with its *.safetensors (or index) for real sizes.")
    return scale, notes


def _quantized_weight_bytes(spec: ModelSpec, request: PlanRequest, dtype: str, start: int, end: int,
                            dense_bytes: int, quant: QuantConfig) -> int:
    """``dense_bytes`` with every quantised linear layer of layers [start, end) counted as the
    platform's kernel holds it instead of as a dense weight."""
    from tengyun.platforms import platform_class

    platform = platform_class(request.device)
    for layer in range(start, end):
        for linear in decoder_linears(spec, request.tp, layer):
            schemes = [quant.scheme_for(part) for part in linear.parts]
            # one layer in one scheme, or (a GGUF's mixed q/k/v) each part as its own shard
            held = (list(zip(schemes, linear.part_outs)) if quant.mixed_shards and linear.part_outs
                    and len(set(schemes)) > 1 else [(next((s for s in schemes if s), None), linear.out)])
            for scheme, out in held:
                if scheme is not None:
                    dense_bytes += linear.count * (
                        platform.quantized_weight_bytes(scheme, out, linear.in_, dtype, linear.in_total)
                        - out * linear.in_ * DTYPE_BYTES[dtype])
    return dense_bytes


def _vocab_bytes_change(spec: ModelSpec, request: PlanRequest, dtype: str, params: StageParams,
                        quant: QuantConfig) -> int:
    """How a stage's bytes change where the checkpoint stores the embedding / LM head quantised
    (QuantConfig.vocab_layers: a GGUF; an untied head compressed-tensors targets by name), held as
    tengyun/layers/embed_head.py holds them: the head through the platform's kernel
    (Platform.quantized_head) or dense; the embedding as its blocks, as nothing when a tied head's
    kernel serves its rows, or dense with a dense tied head."""
    from tengyun.platforms import platform_class

    if not (quant.vocab_layers or quant.named_head):
        return 0
    platform, width = platform_class(request.device), DTYPE_BYTES[dtype]
    rows, hidden, tied = -(-spec.vocab_size // request.tp), spec.hidden_size, spec.tie_word_embeddings
    embed_scheme = quant.scheme_for("model.embed_tokens") if quant.vocab_layers else None
    head_scheme = embed_scheme if tied else quant.head_scheme("lm_head")
    head = platform.quantized_head(head_scheme, dtype) if head_scheme else None
    change = 0
    if params.lm_head or (tied and params.stage == request.pp - 1):  # this stage holds the head
        if head is not None:
            change += platform.quantized_weight_bytes(head_scheme, rows, hidden, dtype) - params.lm_head * width
    if params.embedding and embed_scheme is not None:
        with_head = tied and request.pp == 1
        if with_head and head == "rows":
            change -= params.embedding * width
        elif not with_head or head is not None:  # with a dense tied head it turns dense too
            own = platform.quantized_head(embed_scheme, dtype) == "rows"  # its rows from the kernel's layout
            held = (platform.quantized_weight_bytes(embed_scheme, rows, hidden, dtype) if own
                    else embed_scheme.nbytes(rows, hidden, width))
            change += held - params.embedding * width
    return change


def _stage_plan(spec: ModelSpec, request: PlanRequest, stage: int, dtype: str, kv_dtype: str, scale: float,
                activation: int, max_len: int, quant: QuantConfig | None = None) -> StagePlan:
    """One pipeline stage on one TP rank: its weights, budget, KV blocks and state slots, with the
    functions the engine's worker sizes its caches by (kv_sizing)."""
    tp, pp = request.tp, request.pp
    from tengyun.platforms import platform_class

    last = stage == pp - 1
    params = stage_params(spec, tp, pp, stage, platform_class(request.device).tied_head_copy(dtype, tp),
                          request.mtp_layers)
    start, end = params.layers
    weights = int(params.total * DTYPE_BYTES[dtype] * scale)
    if quant:
        weights = _quantized_weight_bytes(spec, request, dtype, start, end, weights, quant)
        weights += _vocab_bytes_change(spec, request, dtype, params, quant)
    if request.kv_cache_memory is not None:
        budget = request.kv_cache_memory
    else:
        if request.device_memory is None:
            raise ValueError("--device-memory is needed (e.g. 64GiB for an Ascend 910B), "
                             "or --kv-cache-memory to give the KV budget directly.")
        budget = int(request.device_memory * request.gpu_memory_utilization) - weights - activation
    shape = kv_cache_shape(spec, DTYPE_BYTES[kv_dtype], tp, start, end, request.mtp_layers if last else 0)
    state = state_shape(spec, DTYPE_BYTES[dtype], start, end, tp).bytes_per_slot
    blocks, slots, snapshots = split_budget(max(budget, 0), request.block_size, shape, state, request.max_num_seqs,
                                            max_len, request.enable_prefix_caching)
    if shape.num_layers == 0:  # no KV on this stage: it never limits the block count
        blocks = 2**62
    return StagePlan(stage, (start, end), params, weights, budget, shape.num_layers, shape.num_kv_heads,
                     shape.head_dim, shape.bytes_per_token, state, blocks, slots, snapshots)


def tp_candidates(config: ModelSpec | dict[str, Any], limit: int) -> list[int]:
    """TP sizes the engine accepts: powers of two dividing the attention heads, with KV heads
    split or replicated evenly, and the linear-attention heads and experts split evenly."""
    return as_spec(config).tp_sizes(limit)


def smallest_fit(config: ModelSpec | dict[str, Any], request: PlanRequest, checkpoint_bytes: int | None = None,
                 quant: QuantConfig | None = None) -> tuple[int, int] | None:
    """The (tp, pp) with the fewest cards that fits max_model_len (ties: fewer pipeline stages);
    TP stays within --devices-per-node."""
    spec = as_spec(config)
    candidates = [(tp, pp) for tp in spec.tp_sizes(request.devices_per_node)
                  for pp in range(1, spec.num_layers + 1) if tp * pp <= MAX_CARDS]
    for tp, pp in sorted(candidates, key=lambda c: (c[0] * c[1], c[1])):
        if make_plan(spec, dataclasses.replace(request, tp=tp, pp=pp), checkpoint_bytes, quant=quant).fits:
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
                f"weights {plan.dtype}, KV cache {plan.kv_cache_dtype}, on {r.device}")
    lines = [cfg_line, f"Plan: TP {r.tp} x PP {r.pp} = {r.tp * r.pp} card(s); showing stage {s.stage} "
                       f"(layers {s.layers[0]}-{s.layers[1] - 1}), the one that holds the fewest KV blocks", ""]
    p = s.params
    lines.append(f"Weights per card: {p.total:,} params x {DTYPE_BYTES[plan.dtype]} B"
                 + (f" x {plan.weight_scale:.3f}" if plan.weight_scale != 1.0 else "")
                 + f" = {_size(s.weight_bytes)}"
                 + (f" with the quantised linear layers as their kernels hold them ({plan.quantization})"
                    if plan.quantization else ""))
    lines.append(f"  embedding {p.embedding:,} + attention {p.attention:,} + linear attention "
                 f"{p.linear_attention:,} + MLP/MoE {p.mlp:,} + norms {p.norms:,} + LM head {p.lm_head:,}"
                 + (f" + MTP head {p.mtp:,}" if p.mtp else ""))
    if r.kv_cache_memory is not None:
        lines.append(f"KV budget per card: --kv-cache-memory = {_size(s.budget_bytes)} ({s.budget_bytes:,} B)")
    else:
        lines.append(f"Activation reserve: {plan.activation_formula} = {_size(plan.activation_bytes)}")
        lines.append(f"KV budget per card: {_size(r.device_memory)} x {r.gpu_memory_utilization} - "
                     f"{_size(s.weight_bytes)} weights - {_size(plan.activation_bytes)} activations = "
                     f"{_size(s.budget_bytes)} ({s.budget_bytes:,} B)")
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
        "kv_cache_dtype": plan.kv_cache_dtype, "device": r.device, "tensor_parallel_size": r.tp,
        "pipeline_parallel_size": r.pp,
        "device_memory": r.device_memory, "gpu_memory_utilization": r.gpu_memory_utilization,
        "kv_cache_memory": r.kv_cache_memory, "block_size": r.block_size, "max_model_len": plan.max_model_len,
        "activation_bytes": plan.activation_bytes, "weight_scale": plan.weight_scale,
        "checkpoint_bytes": plan.checkpoint_bytes,
        "quantization": plan.quantization,
        "stages": [{
            "stage": s.stage, "layers": list(s.layers),
            "params": dataclasses.asdict(s.params) | {"total": s.params.total},
            "weight_bytes": s.weight_bytes, "budget_bytes": s.budget_bytes, "attention_layers": s.attention_layers,
            "kv_bytes_per_token": s.kv_bytes_per_token, "state_bytes_per_seq": s.state_bytes_per_seq,
            "blocks": s.blocks if s.attention_layers else None, "state_slots": s.state_slots,
            "state_snapshots": s.state_snapshots,
        } for s in plan.stages],
        "blocks": plan.blocks, "cache_tokens": plan.cache_tokens, "max_concurrency": plan.max_concurrency,
        "fits": plan.fits, "smallest_fit": list(fit) if fit else None, "notes": plan.notes,
    }

