"""One rank's budget turned into KV blocks, recurrent-state slots and snapshots: the Worker with
what it measured on its device, `tengyun plan` with the card it plans for."""

from __future__ import annotations

from dataclasses import dataclass

from tengyun.dtypes import DTYPE_BYTES
from tengyun.model_spec import ModelSpec
from tengyun.sizing.cache import KVCacheShape, activation_estimate, split_budget
from tengyun.sizing.resolve import ResolvedSizing

HOST_BUDGET = "--kv-cache-memory / TENGYUN_CPU_KVCACHE_SPACE"
DEVICE_BUDGET = "--gpu-memory-utilization"


@dataclass(frozen=True)
class CacheBudget:
    """Where one rank's bytes for KV and state come from: ``host_bytes`` when given (the KV cache in
    host memory: --kv-cache-memory, else $TENGYUN_CPU_KVCACHE_SPACE or 4 GiB), else the device's
    ``device_total`` x --gpu-memory-utilization - ``in_use`` (weights, runtime) - ``activation``
    (one step's reserve, activation_reserve)."""

    host_bytes: int | None = None
    device_total: int | None = None
    in_use: int = 0
    activation: int = 0

    def bytes(self, gpu_memory_utilization: float) -> tuple[int, str]:
        """(bytes, the flag that sets them); negative when weights and activations exceed the card."""
        if self.host_bytes is not None:
            return self.host_bytes, HOST_BUDGET
        if self.device_total is None:
            raise ValueError("--device-memory is needed (e.g. 64GiB for an Ascend 910B), "
                             "or --kv-cache-memory to give the KV budget directly.")
        return int(self.device_total * gpu_memory_utilization) - self.in_use - self.activation, DEVICE_BUDGET


@dataclass(frozen=True)
class CacheCapacity:
    budget_bytes: int | None  # None: no budget asked (--num-gpu-blocks-override)
    blocks: int
    slots: int
    snapshots: int
    source: str  # the flag that sets the count, for errors


def activation_reserve(spec: ModelSpec, sizing: ResolvedSizing) -> tuple[int, str]:
    """One step's transient bytes per rank (cache.activation_estimate) at the resolved batch sizes."""
    return activation_estimate(spec, sizing.tp, sizing.max_num_batched_tokens, sizing.max_num_seqs,
                               DTYPE_BYTES[sizing.dtype], sizing.pooling)


def cache_capacity(sizing: ResolvedSizing, shape: KVCacheShape, slot_bytes: int, hybrid: bool,
                   budget: CacheBudget | None) -> CacheCapacity:
    """KV blocks, state slots and snapshots on one rank: --num-gpu-blocks-override (every sequence a
    slot, with prefix caching a snapshot each), else ``budget`` split by cache.split_budget.
    ``slot_bytes``: one sequence's recurrent state here (0: no linear-attention layers on this
    rank, which then never limits slots or snapshots: max_num_seqs of them in a ``hybrid`` model)."""
    caching = sizing.enable_prefix_caching
    budget_bytes, source = budget.bytes(sizing.gpu_memory_utilization) if budget else (None, "")
    if sizing.num_gpu_blocks_override is not None:
        blocks, slots, snapshots = sizing.num_gpu_blocks_override, sizing.max_num_seqs, 0
        snapshots, source = (slots if caching else 0), "--num-gpu-blocks-override"
    elif budget_bytes is None:
        raise ValueError("a KV budget is needed without --num-gpu-blocks-override")
    else:
        blocks, slots, snapshots = split_budget(max(budget_bytes, 0), sizing.block_size, shape, slot_bytes,
                                                sizing.max_num_seqs, sizing.max_model_len, caching)
    if not slot_bytes:
        slots = sizing.max_num_seqs if hybrid else 0
        snapshots = slots if caching else 0
    return CacheCapacity(budget_bytes, blocks, slots, snapshots, source)


def check_holds_one_sequence(sizing: ResolvedSizing, blocks: int, shape: KVCacheShape, source: str) -> None:
    """The engine's refusal of a cache that cannot hold one --max-model-len sequence."""
    capacity, block_size, max_len = blocks * sizing.block_size, sizing.block_size, sizing.max_model_len
    if capacity < max_len:
        need = -(-max_len // block_size) * shape.bytes_per_block(block_size)
        raise ValueError(
            f"The KV cache holds {capacity} tokens ({blocks} blocks) but --max-model-len is {max_len}: lower "
            f"--max-model-len to {max(capacity, block_size)} or raise {source} (one sequence of {max_len} tokens "
            f"needs {need / 2**20:.1f} MiB).")
