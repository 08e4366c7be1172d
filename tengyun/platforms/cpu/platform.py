from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from tengyun.host import probe
from tengyun.host.probe import cpu_flags, process_tree_rss
from tengyun.host.telemetry import CpuUse, cpu_reading, parse_meminfo
from tengyun.platforms.base import Platform
from tengyun.platforms.kernel_choice import KernelQuery, choose
from tengyun.platforms.cpu.runtime import allocator

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

"""The CPU platform: what a worker on host cores does once per process (allocator, huge pages,
OpenMP threads, decode graphs: runtime/), the kernels it computes with (kernels/, native.py) and
what it reads of the host for metrics."""

logger = logging.getLogger(__name__)


class CpuPlatform(Platform):
    device_type = "cpu"
    dist_backend = "gloo"
    visible_devices_env = ""
    # torch's CPU runtime survives fork, except OpenMP's thread pool: once this process has run
    # multi-threaded torch work, a forked rank hangs in its first parallel op (docs/parallelism.md).
    fork_safe = True
    repacks_linear_weights = True  # oneDNN's blocked layout (OneDNNPackedLinearKernel), where available
    _loaded_workers = 0  # workers of this process between after_load() and release()
    kv_cache_in_host_memory = True
    supports_graphs = True  # TorchScript traces of small decode steps (cpu/runtime/graphs.py)
    ranks_share_host_cores = True
    # A served step that prefills 2048 tokens holds every running decode and every prompt that
    # arrived with it for ~1.1 s on 2 cores (SmolLM2 bf16); 512-token steps admit new prompts a
    # few at a time at the same GEMM rate (oneDNN: ~212 GFLOP/s a core from 64 to 2048 rows), so
    # arrivals stop coming in waves: median served TTFT 523 / 1038 ms against 1281 / 2524 at
    # concurrency 16 / 64, same tok/s (benchmarks/README.md, "Served: 512-token steps on CPU").
    # The offline LLM class keeps 2048: its batch arrives at once, and admitting it a few prompts
    # a step only lengthens the tail.
    default_batched_tokens_server = 512

    def __init__(self):
        self._cpu_use = CpuUse()  # device_readings' CPU use is measured between two calls

    @classmethod
    def auto_dtype(cls, checkpoint_dtype: str | None) -> str:
        """bfloat16 where the cores multiply bf16 natively (avx512_bf16 or AMX: oneDNN's bf16
        linears run ~2x fp32 on this machine's cores, benchmarks/README.md), whatever the
        checkpoint's dtype: float32 checkpoints (GGUF conversions among them) are downcast, as
        vLLM's CPU build does (vllm/config/model.py _resolve_auto_dtype). float32 on cores that
        would emulate bf16. float16 is never chosen: without AVX512-FP16 it runs ~10x slower here."""
        del checkpoint_dtype  # every checkpoint dtype is served the same way on a given CPU
        return "bfloat16" if native_bf16() else "float32"

    @classmethod
    def tied_head_copy(cls, dtype: str, tp: int) -> bool:
        """One copy where the packed head serves the embedding's lookups (ParallelLMHead.bind_kernels):
        TP = 1, float32 on AVX-512 cores or bfloat16 on AVX512-BF16 ones (the compiled kernels'
        small-batch path, cpu/kernels/linear.py; built by `make setup`), or bfloat16 on AVX2 cores
        where oneDNN packs none (the bfloat16-weight kernel's packed copy, cpu/kernels/bf16_weights.py).
        Elsewhere two copies. A guess from the CPU's flags, for the plan: the kernels actually chosen
        decide the bytes."""
        flags = cpu_flags()
        bf16_served = "avx512_bf16" in flags or ({"avx2", "fma"} <= flags and not onednn_packs_bf16(flags))
        served = {"float32": "avx512f" in flags, "bfloat16": bf16_served}.get(dtype, False)
        return not (tp == 1 and served)

    @classmethod
    def is_available(cls) -> bool:
        return True

    def init_process(self) -> None:
        """Keep freed activation buffers in the heap instead of unmapping them: each step
        allocates many multi-MB temporaries, and fresh mmaps page-fault on every touch
        (prefill of 64 x 128 SmolLM2 tokens 12.2 s -> 10.3 s here). vLLM's CPU docs
        reach for tcmalloc via LD_PRELOAD for the same reason; this needs no preload."""
        allocator.keep_freed_buffers()

    def after_load(self, weights: Sequence[torch.Tensor] = ()) -> None:
        """No new mmaps at all once weights and caches are in place (M_MMAP_MAX 0): blocks above
        the 32 MiB threshold come from the heap too and are reused step after step. Qwen2.5-0.5B's
        prefill of 16 x 128 tokens faulted in its 40 MiB MLP activations afresh in every layer:
        2.9 s -> 1.8 s, as fast as with tcmalloc preloaded. Not before loading: the temporaries
        loading frees still go back to the system. The weights then move onto 2 MiB pages
        (cpu/runtime/hugepages.py): a decode step streams all of them."""
        from tengyun.platforms.cpu.runtime import hugepages as cpu_hugepages

        allocator.no_new_mmaps()
        CpuPlatform._loaded_workers += 1
        started = time.perf_counter()
        moved = cpu_hugepages.collapse(cpu_hugepages.weight_ranges(weights))
        if moved:
            logger.info("Weights on huge pages: %.0f MiB moved onto 2 MiB pages in %.2f s", moved / 2**20,
                        time.perf_counter() - started)

    def release(self) -> None:
        """Once this process's last loaded worker is gone: glibc's defaults again, and the heap's
        free pages given back (malloc_trim). Without it a process that dropped its engine kept
        every block the engine had freed, and the next engine's weights and caches came on top
        (the test suite's one process grew to 22 GiB and was killed)."""
        CpuPlatform._loaded_workers = max(0, CpuPlatform._loaded_workers - 1)
        if CpuPlatform._loaded_workers == 0:
            allocator.restore_defaults()

    def step_threads(self, world_size: int):
        """Also frees the building thread's OpenMP pool, so that the thread that runs the steps
        (serve's engine thread, or this one again) owns the only one (cpu/runtime/threads.py)."""
        from tengyun.platforms.cpu.runtime.threads import model_step_threads, release_openmp_pool

        if not release_openmp_pool():
            logger.debug("No OpenMP runtime answered omp_pause_resource_all; the building thread keeps its pool")
        return model_step_threads(world_size)

    def capture_graph(self, forward, state=(), first=True):
        from tengyun.platforms.cpu.runtime.graphs import trace_decode_forward

        return trace_decode_forward(forward, state, warm_ups=1 if first else 0)

    def graph_batch_limit(self, kernels) -> int:
        """The decode batch sizes the compiled linears are traced for (their ``graph_rows``): the
        small-batch kernel's up to cpu_linear.SMALL_GRAPH_ROWS (64; it takes up to MAX_SMALL_ROWS
        eagerly) or, where oneDNN packs bfloat16 for AMX, the tile kernel's up to AMX_GRAPH_ROWS (64;
        it takes up to AMX_TILE_ROWS, 128, eagerly). A trace cannot hold oneDNN's packed weights (a
        size whose trace fails runs eager). 0 without the compiled kernels, and with any attention
        backend but cpu_paged: a trace freezes host-side logic, and only cpu_paged's decode is known
        to have none."""
        if kernels.attention.name != "cpu_paged":
            return 0
        return getattr(kernels.linear, "graph_rows", 0)

    def graph_blocker(self, tp_size: int) -> str | None:
        return "tensor parallelism (gloo collectives are not traced)" if tp_size > 1 else None

    @classmethod
    def quantized_head(cls, scheme, dtype: str) -> str | None:
        """GGUF in bfloat16 (blocks of 32): the compiled layout ("rows") or torch's int4 layout.
        compressed-tensors (an untied head): W8A8 its int8 kernel; 4- and 8-bit weight-only in
        bfloat16 the compiled layout, or (4 bits) torch's int4 layout."""
        from tengyun.platforms.cpu.kernels import gguf as cpu_gguf

        if scheme.kernel == "wna16_int":  # the kernel the layers get (kernel_candidates), if it streams
            chosen = choose("quant_linear", cls.kernel_candidates("quant_linear"), KernelQuery(dtype, scheme=scheme))
            return "kernel" if chosen.name in ("cpu_int8_layout", "cpu_int4pack") else None
        if not scheme.kernel.startswith("gguf_"):
            return super().quantized_head(scheme, dtype)
        if not cpu_gguf.int4pack_fits(scheme, dtype, 16):
            return None
        return "rows" if cls._compiled_quant_layout() else "kernel"

    @classmethod
    def kernel_candidates(cls, kind: str):
        """The CPU's candidates (cpu/kernels/choice.py), then the plain-PyTorch ones."""
        from tengyun.platforms.cpu.kernels.choice import cpu_candidates

        return cpu_candidates(kind, lambda: cls._compiled_quant_layout()) + super().kernel_candidates(kind)

    @staticmethod
    def _compiled_quant_layout() -> bool:
        """Do 4-bit layers take the compiled kernel's layout here (cpu_quant_layout.quant_gemv_fits)?"""
        from tengyun.platforms.cpu.kernels.quant_layout import quant_gemv_fits

        return quant_gemv_fits()

    def memory_info(self) -> tuple[int, int]:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return free, pages

    def memory_meter(self):
        from tengyun.platforms.cpu.runtime.memory_meter import ResidentPeakMeter

        return ResidentPeakMeter()

    def keep_rng_state(self, device):
        import torch

        return torch.random.fork_rng(devices=[])  # the host's generator is the device's

    def memory_usage(self, pid: int) -> tuple[int, int] | None:
        rss = process_tree_rss(pid)
        return None if rss is None else (rss, self.memory_info()[1])

    def device_readings(self) -> list:
        """One "cpu" reading: this process tree's resident memory out of host RAM, and its CPU use
        since the previous call over the cores it may run on (None on the first call)."""
        pid = os.getpid()
        cpu_s = probe.process_tree_cpu_s(pid)
        use = None if cpu_s is None else self._cpu_use.ratio(cpu_s, time.monotonic(), len(probe.allowed_cpus()))
        return [cpu_reading(process_tree_rss(pid), parse_meminfo(probe.meminfo()), use)]


def onednn_packs_bf16(flags: frozenset[str]) -> bool:
    """Does oneDNN reorder bfloat16 weights on these cores (torch's mkldnn_reorder_linear_weight
    needs AVX512 BW/VL/DQ or AVX-NE-CONVERT, and refuses elsewhere)?"""
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


def native_bf16() -> bool:
    """Do these cores have bf16 dot-product instructions (AVX512-BF16, or AMX-BF16)?"""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
