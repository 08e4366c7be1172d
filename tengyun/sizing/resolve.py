"""The settings that size weights and caches, resolved once for a model on a device type:
EngineConfig.finalize (the device it selected) and `tengyun plan` (the device planned for, never
checked to be here) both call resolve_sizing, so the two cannot disagree on a default."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tengyun.dtypes import canonical_dtype
from tengyun.model_spec import ModelSpec, mtp_layers_for_speculation
from tengyun.pooling_config import resolve_runner
from tengyun.sizing import platform_facts
from tengyun.sizing.data_parallel import expert_parallel_size, expert_split_problem
from tengyun.sizing.pp_layers import pp_layer_partition

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class ResolvedSizing:
    """EngineConfig's sizing settings with every default filled in for ``device``."""

    device: str  # cpu, cuda or npu
    dtype: str  # weights and activations: --dtype, auto resolved (platforms.served_dtype)
    kv_cache_dtype: str
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    tp: int
    pp: int
    gpu_memory_utilization: float
    kv_cache_memory: int | None  # --kv-cache-memory in bytes as given; None: not given
    num_gpu_blocks_override: int | None
    enable_prefix_caching: bool
    mtp_layers: int = 0  # --speculative-config method mtp: the MTP head's layers on the last stage
    pp_layers: tuple[int, ...] | None = None  # decoder layers per pipeline stage (pp_layers.py); None: pp 1
    expert_parallel: bool = False  # --enable-expert-parallel: MoE experts whole over the tp ranks (the EP group)
    pooling: bool = False  # --runner pooling (docs/pooling.md): no LM head, no logits, pooled rows instead
    dp: int = 1  # --data-parallel-size: replicas, each holding every tp x pp card's weights and its own KV cache
    lora_slots: tuple[int, int, str] | None = None  # --enable-lora: (--max-loras, --max-lora-rank, slot dtype)

    @property
    def expert_ranks(self) -> int:
        """Ranks one MoE layer's routed experts are divided among: tp, or dp x tp under data and
        expert parallelism (the EP group spans the replicas)."""
        return expert_parallel_size(self.tp, self.dp) if self.expert_parallel else self.tp


def resolve_sizing(settings: Any, spec: ModelSpec, device: str, folder: Path | None = None,
                   block_size_default: int | None = None) -> ResolvedSizing:
    """``settings``: an EngineConfig as the user set it (its flags' values, checked by its
    constructor); ``spec``: the model; ``device``: "cpu", "cuda" or "npu"; ``folder``: the model's
    (a Qwen3-Next's MTP layers are counted there; None: config.json's count only);
    ``block_size_default``: the selected platform's own (CUDA's depends on the serving machine),
    else the platform class's (platform_facts). Raises ValueError naming the flag to change."""
    dtype = platform_facts.served_dtype(settings.dtype, device, spec.checkpoint_dtype)
    kv_dtype = dtype if settings.kv_cache_dtype == "auto" else canonical_dtype(settings.kv_cache_dtype)
    block_size = settings.block_size or block_size_default or platform_facts.default_block_size(device)
    if problem := platform_facts.settings_problem(device, block_size, dtype, kv_dtype):
        raise ValueError(problem)  # the device's kernels cannot run these settings (NPU: docs/ascend.md)
    max_model_len = _max_model_len(settings.max_model_len, spec)
    _check_parallel_fits_model(spec, settings.tensor_parallel_size, settings.pipeline_parallel_size)
    expert_parallel = bool(getattr(settings, "enable_expert_parallel", False))
    dp = getattr(settings, "data_parallel_size", 1)
    if expert_parallel and (problem := expert_split_problem(spec, settings.tensor_parallel_size, dp)):
        raise ValueError(problem)
    speculative = settings.speculative_config
    mtp_layers = (mtp_layers_for_speculation(spec, folder, speculative.num_speculative_tokens)
                  if speculative is not None and speculative.method == "mtp" else 0)
    return ResolvedSizing(
        device=device, dtype=dtype, kv_cache_dtype=kv_dtype,
        block_size=block_size,
        max_model_len=max_model_len, max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=_max_num_batched_tokens(settings, max_model_len, device),
        tp=settings.tensor_parallel_size, pp=settings.pipeline_parallel_size,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        kv_cache_memory=None if settings.kv_cache_memory is None else int(settings.kv_cache_memory),
        num_gpu_blocks_override=settings.num_gpu_blocks_override,
        enable_prefix_caching=settings.enable_prefix_caching, mtp_layers=mtp_layers,
        pp_layers=pp_layer_partition(spec, settings.pipeline_parallel_size), expert_parallel=expert_parallel,
        pooling=resolve_runner(spec.architecture, settings.runner, settings.convert)[0] == "pooling",
        lora_slots=_lora_slots(settings, dtype), dp=dp)


def _lora_slots(settings: Any, dtype: str) -> tuple[int, int, str] | None:
    """--enable-lora's device slots as LoRAManager allocates them: --max-loras of rank --max-lora-rank
    in --lora-dtype (auto: the served dtype); None without it."""
    if not settings.enable_lora:
        return None
    lora_dtype = dtype if settings.lora_dtype == "auto" else canonical_dtype(settings.lora_dtype)
    return settings.max_loras, settings.max_lora_rank, lora_dtype


def _max_model_len(requested: int | None, spec: ModelSpec) -> int:
    model_max = spec.max_position_embeddings
    if requested is not None and requested > model_max:
        raise ValueError(f"--max-model-len {requested} is longer than the model's max_position_embeddings "
                         f"{model_max}: lower --max-model-len to {model_max}.")
    return requested or model_max


def _max_num_batched_tokens(settings: Any, max_model_len: int, device: str) -> int:
    """--max-num-batched-tokens, by default the platform's for the usage context (2048; 512 for
    `tengyun serve` on CPU) and never below --max-num-seqs (every running decode fits a step),
    without chunked prefill at least one whole prompt."""
    chunked, tokens = settings.enable_chunked_prefill, settings.max_num_batched_tokens
    if tokens is None:
        default = platform_facts.default_max_num_batched_tokens(device, getattr(settings, "usage_context", "llm"))
        tokens = max(default, settings.max_num_seqs) if chunked else max(default, max_model_len, settings.max_num_seqs)
    if not chunked and tokens < max_model_len:
        raise ValueError(
            f"--max-num-batched-tokens {tokens} is smaller than --max-model-len {max_model_len} with chunked "
            f"prefill off, so a long prompt could never be scheduled: raise --max-num-batched-tokens to "
            f"{max_model_len}, lower --max-model-len, or pass --enable-chunked-prefill.")
    if not chunked and tokens < settings.max_num_seqs:
        raise ValueError(f"--max-num-batched-tokens {tokens} must be >= --max-num-seqs {settings.max_num_seqs}: "
                         f"raise it to {settings.max_num_seqs}.")
    return tokens


def _check_parallel_fits_model(spec: ModelSpec, tp: int, pp: int) -> None:
    problem = spec.tp_problem(tp)
    if problem:
        works = [n for n in range(1, spec.num_attention_heads + 1) if spec.tp_problem(n) is None]
        raise ValueError(f"--tensor-parallel-size {tp} {problem}: use one of {works}.")
    if pp > spec.num_layers:
        raise ValueError(f"--pipeline-parallel-size {pp} is more than num_hidden_layers {spec.num_layers}: "
                         f"use at most {spec.num_layers}.")
