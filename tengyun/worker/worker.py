"""Worker: owns the device — builds the model, loads weights, sizes and allocates the KV cache."""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
import weakref

import torch

from tengyun.config import EngineConfig
from tengyun.distributed.parallel_state import (
    RankInfo, all_reduce_max, all_reduce_min, get_pp_rank, get_pp_size, get_rank, get_tp_size, init_distributed,
)
from tengyun.distributed import data_parallel
from tengyun.distributed.pipeline_stage import PipelineStage
from tengyun.engine.messages import ModelRunnerOutput, SchedulerOutput
from tengyun.sizing.blocks import CacheBudget, activation_reserve, cache_capacity, check_holds_one_sequence
from tengyun.sizing.cache import KVCacheShape, kv_cache_shape, state_shape
from tengyun.sizing.resolve import ResolvedSizing
from tengyun.layers.fused_moe import run_moe_exchanges_without_tokens
from tengyun.layers.kernels import KernelBundle, bind_kernels
from tengyun.layers.lora.manager import LoRAManager
from tengyun.layers.moe.load_counter import ExpertLoadCounter
from tengyun.layers.quantized import apply_quant_config
from tengyun.layers.weight_loading import deferred_weights, drop_weight_loaders
from tengyun.model_spec import DTYPE_BYTES
from tengyun.models.loader import load_weights
from tengyun.models.registry import model_class_for
from tengyun.host.numa import bind_to_device_numa
from tengyun.platforms import Platform, get_platform
from tengyun.structured_output import grammar_compiler_for_config
from tengyun.worker.kv_cache import allocate_kv_cache
from tengyun.worker.decode_graphs import DecodeGraphs
from tengyun.worker.model_runner import ModelRunner
from tengyun.worker.memory_profile import CacheLayout, MemoryReport, ProfileResult, run_profile_step
from tengyun.worker.mtp_proposer import MtpProposer
from tengyun.worker.state_cache import StateSnapshotRows, allocate_state_cache

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Worker:
    """One rank. ``rank`` is None for the single-process engine (rank 0 of 1)."""

    def __init__(self, config: EngineConfig, rank: RankInfo | None = None):
        self.config = config
        self.rank = rank
        self.platform, self.device = self._init_device()
        started = time.perf_counter()
        self.model = self._load_model()
        self.kernels = self._bind_kernels()
        self.lora = self._lora_manager()  # before the caches are sized: its slots take memory too
        dtype = TORCH_DTYPES[config.dtype]
        self.mtp_head = (MtpProposer.load_head(config, self.model, self.kernels, dtype, self.device)
                         if self._runs_mtp_head() else None)
        for module in (self.model, self.mtp_head):
            if module is not None:
                drop_weight_loaders(module)
        # After binding: repacked weights count, freed ones not; the MTP head's too.
        self.weight_bytes = weight_bytes(self.model) + (weight_bytes(self.mtp_head) if self.mtp_head is not None else 0)
        logger.info("Loaded %s (%s, %s) in %.1f s: %.1f MiB of weights on rank %d", config.architecture,
                    config.dtype, config.load_format, time.perf_counter() - started,
                    self.weight_bytes / 2**20, get_rank())
        self._cache_shapes()
        self.profile = self._profile_step()
        self.num_blocks, self.num_state_slots, self.num_state_snapshots = self._count_kv_blocks(
            self._budgeted_kv_shape(), self.state_shape.bytes_per_slot)
        # --enable-expert-load-metrics: counting from here (not the profile step); before the graphs' check
        self.expert_load = ExpertLoadCounter(self.model, self.device) if config.enable_expert_load_metrics else None
        # Decode graphs pad batches into one extra KV block and state slot that no sequence gets.
        graphs = self._use_decode_graphs()
        self.state_cache, self.kv_cache = self._allocate_caches(extra=int(graphs))
        self.runner = self._build_runner(graphs)
        self.platform.after_load([t for module in (self.model, self.mtp_head) if module is not None
                                  for t in weight_tensors(module)])
        self._release_platform = weakref.finalize(self, self.platform.release)  # shutdown(), or collected
        self.step_threads = self.platform.step_threads(rank.world_size if rank else 1)
        self.memory_report = self._memory_report()
        logger.info("%s", self.memory_report.summary())

    def shutdown(self) -> None:
        """The in-process engine's end (``llm.llm_engine.shutdown()``): its weights, caches and
        graphs go now rather than with the LLM object, and the platform's process tuning is undone."""
        self.model = self.mtp_head = self.runner = self.kv_cache = self.state_cache = None
        self.lora = None
        gc.collect()
        self._release_platform()

    def _init_device(self) -> tuple[Platform, torch.device]:
        """This process's device made current, pinned near it (NUMA), tuned, joined to the other ranks."""
        config, rank = self.config, self.rank
        platform = get_platform(config.device)
        device = platform.torch_device(rank.local_rank if rank else 0)
        platform.set_device(device)
        bind_to_device_numa(device.index or 0, config.numa_bind, platform.device_type)
        platform.init_process()
        if rank is not None and rank.world_size > 1:
            init_distributed(rank, platform.dist_backend, setup_timeout_s=config.distributed_timeout)
        data_parallel.join_replicas(config, rank.tp_rank if rank else 0)  # -dp N --enable-expert-parallel
        torch.manual_seed(config.seed)
        return platform, device

    def _load_model(self) -> torch.nn.Module:
        config = self.config
        model_cls = model_class_for(config)
        # Linear and MoE weights wait on the meta device until the checkpoint's quantisation says
        # what they hold: a quantised layer never allocates its dense weight.
        with torch.device(self.device), deferred_weights():
            model = model_cls(config.model_spec, config.max_model_len, TORCH_DTYPES[config.dtype]).eval()
        self.quant_schemes = apply_quant_config(model, config.quant_config, self.device)
        load_weights(model, config.model_path, config.load_format, seed=config.seed,
                     fp8_block=config.model_spec.fp8_block)
        return model

    def _bind_kernels(self) -> KernelBundle:
        """The platform's kernels, handed to every layer once its weights are loaded."""
        config = self.config
        kernels = self.platform.kernels(TORCH_DTYPES[config.dtype], config.block_size, config.kv_cache_dtype,
                                        linear_attention=config.model_spec.is_hybrid, quant_schemes=self.quant_schemes)
        bind_kernels(self.model, kernels)
        return kernels

    def _cache_shapes(self) -> None:
        """kv_shape and state_shape of this rank's layers."""
        config = self.config
        tp = config.tensor_parallel_size
        start, end = config.model_spec.stage_layers(get_pp_rank(), get_pp_size())
        self.kv_shape = kv_cache_shape(config.model_spec, DTYPE_BYTES[config.kv_cache_dtype], tp, start, end)
        # Hybrid models: Gated DeltaNet layers keep per-sequence state in slots (docs/hybrid_cache.md).
        self.state_shape = state_shape(config.model_spec, DTYPE_BYTES[config.dtype], start, end, tp)

    def _profile_step(self) -> ProfileResult:
        """The largest step this rank can be sent, run once on a temporary cache (memory_profile.py)."""
        config, spec = self.config, self.config.model_spec
        layout = CacheLayout(self.kv_shape, self.state_shape, config.block_size,
                             TORCH_DTYPES[config.kv_cache_dtype], TORCH_DTYPES[config.dtype])
        started = time.perf_counter()
        self.step_sizing = self._profiled_sizing()
        result = run_profile_step(self.model, self.kernels, self.platform, self.device, layout, self.step_sizing,
                                  spec.vocab_size, spec.hidden_size)
        logger.info("Profile step (%d tokens over %d sequences) in %.2f s: %s", result.shape.tokens,
                    result.shape.seqs, time.perf_counter() - started,
                    "n/a" if result.peak is None else f"{result.peak / 2**20:.1f} MiB above the weights")
        return result

    def _profiled_sizing(self) -> ResolvedSizing:
        """config.sizing with the largest step budget over the ranks, so every rank profiles (and runs
        the profile's collectives at) one shape and reserves for it: a `tengyun serve --headless`
        node resolves serve's default (512 tokens on CPU), a head that is the LLM class its own
        (2048), and only the head schedules."""
        sizing = self.config.sizing
        budget = all_reduce_max(sizing.max_num_batched_tokens)
        if budget != sizing.max_num_batched_tokens:
            logger.info("Profiling %d-token steps, the largest budget over the ranks (this node resolved "
                        "--max-num-batched-tokens %d)", budget, sizing.max_num_batched_tokens)
        return dataclasses.replace(sizing, max_num_batched_tokens=budget)

    def _activation_bytes(self) -> tuple[int, str]:
        """(bytes one step takes, where the figure comes from): the profile step's peak, or the
        estimate `tengyun plan` uses where the platform cannot measure it."""
        if self.profile.peak is not None:
            return self.profile.peak, f"measured: {self.profile.meter}"
        return activation_reserve(self.config.model_spec, self.step_sizing)

    @property
    def memory_reports(self) -> list[dict]:
        """As the multi-process executor lists its ranks' (the single-process engine is its own executor)."""
        return [self.memory_report.as_json()]

    def _memory_report(self) -> MemoryReport:
        config = self.config
        activation, _ = self._activation_bytes()
        free, total = self.platform.memory_info()
        available = free if self.platform.kv_cache_in_host_memory else (
            int(total * config.gpu_memory_utilization) - (total - free))
        state = sum(t.numel() * t.element_size() for t in self.state_cache)
        return MemoryReport(
            rank=get_rank(), weights=self.weight_bytes, activation_peak=self.profile.peak,
            activation_estimate=activation_reserve(config.model_spec, self.step_sizing)[0],
            activation_used=activation, measured_by=self.profile.meter, profile_tokens=self.profile.shape.tokens,
            profile_seqs=self.profile.shape.seqs, kv_cache=self.kv_cache.numel() * self.kv_cache.element_size(),
            state_cache=state, memory_total=total, headroom=available - activation)

    def _budgeted_kv_shape(self) -> KVCacheShape:
        """The KV shape the budget is split by: with --speculative-config method mtp, on the last
        pipeline stage, the MTP head's attention layers too (its own cache holds one layer each
        under the engine's block ids)."""
        if not self._runs_mtp_head():
            return self.kv_shape
        config = self.config
        start, end = config.model_spec.stage_layers(get_pp_rank(), get_pp_size())
        return kv_cache_shape(config.model_spec, DTYPE_BYTES[config.kv_cache_dtype], config.tensor_parallel_size,
                              start, end, extra_layers=config.model_spec.mtp_num_layers)

    def _runs_mtp_head(self) -> bool:
        """--speculative-config method mtp: the head runs on the last pipeline stage (every TP rank)."""
        spec = self.config.speculative_config
        return spec is not None and spec.method == "mtp" and get_pp_rank() == get_pp_size() - 1

    def _allocate_caches(self, extra: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(state cache, KV cache) with ``extra`` blocks and slots beyond those the scheduler hands out."""
        config = self.config
        # Rows: running slots, `extra` padding slots, then the prefix cache's snapshot rows.
        state_cache = allocate_state_cache(self.model, self.state_shape,
                                           self.num_state_slots + extra + self.num_state_snapshots,
                                           TORCH_DTYPES[config.dtype], self.device)
        if self.num_state_slots:
            logger.info("Recurrent state: %d slots + %d prefix-cache snapshots x %.1f MiB", self.num_state_slots,
                        self.num_state_snapshots, self.state_shape.bytes_per_slot / 2**20)
        if self.num_state_slots and config.enable_prefix_caching and not self.num_state_snapshots:
            logger.warning("Prefix caching finds no hits: the budget left no room for a recurrent-state snapshot "
                           "(%s B each); raise the KV budget or lower --max-num-seqs.",
                           f"{self.state_shape.bytes_per_slot:,}")
        kv_cache = allocate_kv_cache(self.model, self.kv_shape, self.num_blocks + extra, config.block_size,
                                     TORCH_DTYPES[config.kv_cache_dtype], self.device)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB", self.num_blocks,
                    config.block_size, self.num_blocks * config.block_size,
                    kv_cache.numel() * kv_cache.element_size() / 2**30)
        return state_cache, kv_cache

    def _build_runner(self, graphs: bool) -> ModelRunner:
        config = self.config
        stage = PipelineStage(config.model_spec.hidden_size, TORCH_DTYPES[config.dtype], self.device)
        decode_graphs = DecodeGraphs(
            self.model, self.platform.capture_graph, self._graph_batch_limit(),
            -(-config.max_model_len // config.block_size), config.block_size, pad_block=self.num_blocks,
            pad_slot=self.num_state_slots, device=self.device) if graphs else None
        # a stage without linear-attention layers copies no snapshots
        snapshot_rows = StateSnapshotRows(self.state_cache, self.num_state_slots + int(graphs)) \
            if self.num_state_snapshots else None
        mtp = MtpProposer.build(config, self.mtp_head, self.model, self.num_blocks + int(graphs),
                                TORCH_DTYPES[config.kv_cache_dtype], self.device) if self.mtp_head is not None else None
        return ModelRunner(self.model, config.block_size, config.model_spec.vocab_size, self.device, self.kernels,
                           grammar_compiler_factory=lambda: grammar_compiler_for_config(config), stage=stage,
                           decode_graphs=decode_graphs, snapshot_rows=snapshot_rows, mtp=mtp, lora=self.lora,
                           expert_load=self.expert_load)

    def _lora_manager(self) -> LoRAManager | None:
        """--enable-lora: --max-loras slots of rank --max-lora-rank in every targeted linear of this
        rank, in --lora-dtype (tengyun/layers/lora/manager.py); None without it."""
        config = self.config
        if not config.enable_lora:
            return None
        dtype = TORCH_DTYPES[config.dtype if config.lora_dtype == "auto" else config.lora_dtype]
        return LoRAManager(self.model, config.model_spec, config.max_loras, config.max_lora_rank,
                           config.max_cpu_loras or config.max_loras, dtype, self.device, self.kernels.lora)

    def _use_decode_graphs(self) -> bool:
        """Graphs where the platform captures them, unless --enforce-eager or something in the
        model cannot be captured (then one log line says what)."""
        if not self.platform.supports_graphs or self.config.enforce_eager:
            return False
        reason, backend = None, self.kernels.attention
        if self.lora is not None:
            reason = "--enable-lora (each step's token -> adapter slot map)"
        elif get_pp_size() > 1:
            reason = "pipeline parallelism (activations cross ranks between stages)"
        elif blocker := self.platform.graph_blocker(get_tp_size()):
            reason = blocker
        elif not backend.supports_decode_graphs:
            reason = f"the {backend.name} attention backend"
        elif any(not getattr(m, "supports_graph_capture", True) for m in self.model.modules()):
            reason = "MoE routing (per-expert token counts go to the host, or --enable-expert-load-metrics counts them)"
        elif self._graph_batch_limit() < 1:
            reason = (f"the {backend.name} attention backend with {type(self.kernels.linear).__name__} "
                      f"(no decode batch size this platform records)")
        if reason:
            logger.info("Decode graphs off: %s cannot be captured; running eager.", reason)
        return reason is None

    def _graph_batch_limit(self) -> int:
        """Decode batches up to this many sequences replay graphs; larger ones run eager."""
        return min(self.config.max_num_seqs, self.platform.graph_batch_limit(self.kernels))

    def _count_kv_blocks(self, shape: KVCacheShape, slot_bytes: int = 0) -> tuple[int, int, int]:
        """(KV blocks, state slots, state snapshots) that fit here (sizing.blocks.cache_capacity, as
        `tengyun plan` counts them), then the fewest over all ranks: every rank holds the same ids.
        ``slot_bytes``: one sequence's recurrent state (0: none)."""
        config = self.config
        budget = None
        if config.num_gpu_blocks_override is None:
            budget = (CacheBudget(host_bytes=config.kv_cache_budget_bytes())
                      if self.platform.kv_cache_in_host_memory else self._device_kv_budget())
        capacity = cache_capacity(config.sizing, shape, slot_bytes, config.model_spec.is_hybrid, budget)
        counts = tuple(all_reduce_min(n) for n in (capacity.blocks, capacity.slots, capacity.snapshots))
        check_holds_one_sequence(config.sizing, counts[0], shape, capacity.source)
        return counts

    def _device_kv_budget(self) -> CacheBudget:
        """An accelerator's memory x --gpu-memory-utilization, less what is in use now (weights,
        runtime) and what one step takes: the profile step's measured peak (memory_profile.py), or
        where the platform cannot measure it the estimate `tengyun plan` subtracts."""
        config = self.config
        free, total = self.platform.memory_info()
        activation, formula = self._activation_bytes()
        logger.info("KV budget: %.2f GiB x %s - %.2f GiB in use - %.2f GiB activations (%s)", total / 2**30,
                    config.gpu_memory_utilization, (total - free) / 2**30, activation / 2**30, formula)
        return CacheBudget(device_total=total, in_use=total - free, activation=activation)

    def execute_model(self, sched: SchedulerOutput,
                      sampled_elsewhere: dict[int, list[int]] | None = None) -> ModelRunnerOutput | None:
        if self.runner is None:
            raise RuntimeError("This engine was shut down (llm_engine.shutdown()) and holds no model any more; "
                               "build a new LLM to generate again.")
        keep_stepping = data_parallel.step_vote(*sched.dp_wave) if data_parallel.active() else None
        if self.step_threads is None:
            output = self.runner.execute(sched, sampled_elsewhere)
        else:
            with self.step_threads(sched.total_num_scheduled_tokens):
                output = self.runner.execute(sched, sampled_elsewhere)
        if keep_stepping is not None:  # a data-parallel replica stepping with the others
            if sched.is_empty:
                run_moe_exchanges_without_tokens(self.runner.model)
            if output is not None:
                output.dp_keep_stepping = keep_stepping
        return output

    def check_health(self) -> None:
        """The single-process worker lives in the engine's process: nothing can die separately."""


def weight_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors of weights this rank holds: parameters and the kernels' repacked weights."""
    tensors = [p.data for p in model.parameters()]
    for m in model.modules():  # quantised layers' kernels keep dicts of tensors (a list of them per expert)
        tensors += _tensors_in(getattr(m, "kernel_weight", None))
    return tensors


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights this rank holds: parameters and repacked kernel weights, shared storage once."""
    seen, total = set(), 0
    for t in weight_tensors(model):
        if not isinstance(t, torch.Tensor) or not t.numel():
            continue
        if t.is_mkldnn:  # oneDNN's blocked layout: opaque storage, same element count
            total += t.numel() * t.element_size()
            continue
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _tensors_in(prepared) -> list:
    """The tensors of a kernel's prepared weight: a tensor, dicts and lists of them, or an object
    whose ``tensors()`` lists them."""
    if isinstance(prepared, dict):
        prepared = list(prepared.values())
    if isinstance(prepared, list):
        return [t for item in prepared for t in _tensors_in(item)]
    if hasattr(prepared, "tensors"):  # a kernel's own holder (platforms/cpu/kernels/linear.py PackedLinearWeight)
        return prepared.tensors()
    return [] if prepared is None else [prepared]
