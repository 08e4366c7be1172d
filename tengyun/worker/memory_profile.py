"""The profile step: before its KV cache is sized, each rank runs one step of the largest shape
the scheduler can send it and measures the memory that step takes above what is already
allocated, through the platform's meter (platforms/memory_meter.py), as vLLM's profile run does.

The step: --max-num-batched-tokens tokens over as many sequences as --max-num-seqs allows, every
one sampling (logits and sampler over the most rows), the rest in prefill chunks as long as
--max-model-len allows (the longest attention), on a temporary cache freed afterwards. On an
accelerator the measured peak is what the KV budget leaves room for (worker.py); everywhere it is
logged and reported with weights, KV and headroom (MemoryReport: /health/detail, `tengyun plan
--profile-json`)."""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass

import torch
from torch import nn

from tengyun.distributed.pipeline_stage import PipelineStage
from tengyun.engine.messages import NewSeqData, SchedulerOutput
from tengyun.sampling_params import SamplingParams
from tengyun.sizing.cache import KVCacheShape, StateShape
from tengyun.worker.kv_cache import allocate_kv_cache, release_kv_cache
from tengyun.worker.model_runner import ModelRunner
from tengyun.worker.state_cache import allocate_state_cache, release_state_cache

# Full sampling (top-p sorts the vocabulary): the sampler's largest temporaries.
_PROFILE_SAMPLING = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.95)


@dataclass(frozen=True)
class ProfileShape:
    """decode_seqs sequences schedule one token each (one already computed: decode attention over a
    context of 2); each prefill chunk is a whole prompt of that many tokens."""

    decode_seqs: int
    prefill_lens: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return self.decode_seqs + sum(self.prefill_lens)

    @property
    def seqs(self) -> int:
        return self.decode_seqs + len(self.prefill_lens)

    def blocks(self, block_size: int) -> int:
        return self.decode_seqs + sum(-(-n // block_size) for n in self.prefill_lens)


def profile_shape(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> ProfileShape:
    """The step with the most tokens, sampled rows and longest chunk the scheduler can form."""
    chunks = min(-(-max_num_batched_tokens // max_model_len), max_num_seqs)
    tokens = min(max_num_batched_tokens, chunks * max_model_len)
    decode = min(max_num_seqs - chunks, tokens - chunks) if max_model_len > 1 else 0
    prefill = tokens - decode  # >= chunks: every chunk at least one token
    full, rest = divmod(prefill, max_model_len)
    return ProfileShape(decode, (max_model_len,) * full + ((rest,) if rest else ()))


def profile_step(shape: ProfileShape, block_size: int, vocab_size: int, hybrid: bool) -> SchedulerOutput:
    """The scheduler's output for ``shape``: sequence i on state slot i (hybrid models), blocks
    numbered from 0, token ids spread over the vocabulary (MoE routing sees many experts)."""
    sched, next_block, next_token = SchedulerOutput(), 0, 0
    lens = [(2, 1)] * shape.decode_seqs + [(n, 0) for n in shape.prefill_lens]  # (tokens, computed)
    for seq_id, (length, computed) in enumerate(lens):
        blocks = -(-length // block_size)
        tokens = [(next_token + 7919 * i) % vocab_size for i in range(length)]
        sched.new_seqs.append(NewSeqData(seq_id, tokens, length, list(range(next_block, next_block + blocks)),
                                         computed, _PROFILE_SAMPLING, seq_id if hybrid else -1))
        sched.num_scheduled_tokens[seq_id] = length - computed
        next_block, next_token = next_block + blocks, next_token + 1
    return sched


@dataclass(frozen=True)
class ProfileResult:
    shape: ProfileShape
    meter: str  # how the peak was measured
    peak: int | None  # bytes above what was allocated before the step; None: not measurable here


@dataclass(frozen=True)
class CacheLayout:
    """What the temporary cache is built like: the real one's shapes and dtypes."""

    kv_shape: KVCacheShape
    state_shape: StateShape
    block_size: int
    kv_dtype: torch.dtype
    dtype: torch.dtype


@torch.inference_mode()
def run_profile_step(model: nn.Module, kernels, platform, device: torch.device, layout: CacheLayout,
                     sizing, vocab_size: int, hidden_size: int) -> ProfileResult:
    """One profile step on every rank in step (TP and PP collectives run as in a real step); the
    temporary cache and runner are gone when it returns. ``sizing``: the resolved settings."""
    shape = profile_shape(sizing.max_num_batched_tokens, sizing.max_num_seqs, sizing.max_model_len)
    hybrid = layout.state_shape.num_layers > 0
    if hybrid:
        allocate_state_cache(model, layout.state_shape, shape.seqs, layout.dtype, device)
    allocate_kv_cache(model, layout.kv_shape, shape.blocks(layout.block_size), layout.block_size,
                      layout.kv_dtype, device)
    runner = ModelRunner(model, layout.block_size, vocab_size, device, kernels,
                         stage=PipelineStage(hidden_size, layout.dtype, device))
    sched = profile_step(shape, layout.block_size, vocab_size, hybrid)
    meter = platform.memory_meter()
    try:
        with platform.keep_rng_state(device):  # it samples; seeded runs must draw afterwards as before
            meter.start()
            runner.execute(sched)
            peak = meter.peak()
    finally:
        release_kv_cache(model)
        release_state_cache(model)
        del runner
        gc.collect()
        meter.release_cached()
    return ProfileResult(shape, meter.name, peak)


@dataclass(frozen=True)
class MemoryReport:
    """One rank's memory once its caches are allocated, in bytes."""

    rank: int
    weights: int
    activation_peak: int | None  # measured by the profile step; None: not measurable here
    activation_estimate: int  # sizing.blocks.activation_reserve's formula, as `tengyun plan` takes it
    activation_used: int  # what the KV budget left room for: the peak, else the estimate
    measured_by: str
    profile_tokens: int
    profile_seqs: int
    kv_cache: int
    state_cache: int
    memory_total: int  # the device's, or host RAM where the KV cache is in host memory
    headroom: int  # left under the budget (device x --gpu-memory-utilization, or free host RAM) after one step

    def as_json(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        def mib(n: int | None) -> str:
            return "n/a" if n is None else f"{n / 2**20:.1f} MiB"

        peak = (f"activation peak {mib(self.activation_peak)} measured ({self.measured_by}, a step of "
                f"{self.profile_tokens} tokens over {self.profile_seqs} sequences; estimate "
                f"{mib(self.activation_estimate)})" if self.activation_peak is not None else
                f"activation estimate {mib(self.activation_estimate)} (not measurable: {self.measured_by})")
        return (f"Memory on rank {self.rank}: weights {mib(self.weights)}, {peak}, KV cache {mib(self.kv_cache)}"
                + (f", recurrent state {mib(self.state_cache)}" if self.state_cache else "")
                + f", headroom {mib(self.headroom)} of {mib(self.memory_total)}")
