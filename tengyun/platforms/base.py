"""The small interface every device platform implements."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tengyun.dtypes import DTYPE_BYTES, dtype_name
from tengyun.platforms.kernel_choice import Choice, KernelCandidate, KernelQuery, always, choose

if TYPE_CHECKING:
    import torch


class Platform:
    device_type: str = ""
    dist_backend: str = ""
    visible_devices_env: str = ""
    default_block_size: int = 16  # tokens per KV block when --block-size is not given
    # Tokens one scheduler step runs without --max-num-batched-tokens, by usage context as vLLM
    # sets it (the offline LLM class, the API server); 2048 is vLLM's CPU API-server default.
    default_batched_tokens_llm: int = 2048
    default_batched_tokens_server: int = 2048
    supports_graphs: bool = False  # decode steps can be captured and replayed (capture_graph)
    # A rank forked from the engine process can still use the device. False where detecting the
    # device (is_available, run by EngineConfig.finalize) already initialises a runtime that does
    # not survive fork: CUDA's cudaGetDeviceCount calls cuInit; Ascend's ACL is treated the same.
    fork_safe: bool = False
    # The linear kernel keeps weights in its own layout (a copy): a tied LM head then holds the
    # embedding matrix twice, once for lookups and once packed, unless tied_head_copy says the
    # packed copy serves the lookups. `tengyun plan` counts it.
    repacks_linear_weights: bool = False
    # The KV cache lives in host RAM, sized in bytes by --kv-cache-memory (TENGYUN_CPU_KVCACHE_SPACE);
    # otherwise it takes a fraction of device memory (--gpu-memory-utilization).
    kv_cache_in_host_memory: bool = False
    # Ranks compute on host cores (OpenMP threads): a node's ranks split its cores between them.
    ranks_share_host_cores: bool = False
    # The device multiplies FP8 (e4m3) weights natively. Where it does not (CPU, Ascend 910B), an FP8
    # block-quantized checkpoint is dequantized at load to --dtype, and `tengyun plan` counts its
    # weights in that dtype rather than as the checkpoint holds them.
    fp8_matmul: bool = False

    @classmethod
    def auto_dtype(cls, checkpoint_dtype: str | None) -> str:
        """What --dtype auto serves a checkpoint stored in ``checkpoint_dtype`` (None: config.json
        says nothing) as; the engine and `tengyun plan` both ask here. Accelerators, as vLLM: the
        checkpoint's 16-bit dtype, and bfloat16 for float32 or unknown checkpoints."""
        return checkpoint_dtype if checkpoint_dtype in ("bfloat16", "float16") else "bfloat16"

    @classmethod
    def tied_head_copy(cls, dtype: str, tp: int) -> bool:
        """Does a tied LM head served in ``dtype`` at tensor-parallel size ``tp`` hold its own copy
        of the vocab x hidden matrix next to the embedding's? Torch-free: `tengyun plan` asks."""
        return cls.repacks_linear_weights

    @classmethod
    def is_available(cls) -> bool:
        raise NotImplementedError

    def check_available(self) -> None:
        """Raise a RuntimeError that says what to install or source when the device is unusable."""
        if not self.is_available():
            raise RuntimeError(f"--device {self.device_type} was requested but is not available.")

    # Start-up checks (tengyun/platforms/startup.py select_platform), run before any model work.
    @classmethod
    def runtime_installed(cls) -> bool:
        """The device's runtime package is installed (it may still fail to start)."""
        return True

    @classmethod
    def runtime_problem(cls, timeout_s: float):
        """Why this device cannot be used here, as a startup.RuntimeProblem; None when it can.
        May start the runtime in a child process, given up on after ``timeout_s``."""
        from tengyun.platforms.startup import RuntimeProblem

        if cls.is_available():
            return None
        return RuntimeProblem(f"{cls.device_type} is not available", "pass --device cpu", installed=False)

    @classmethod
    def check_versions(cls) -> None:
        """Raise startup.DeviceStartupError when this device's software versions are a combination
        known not to work (tengyun/host/compat_table.json); nothing to check by default."""

    def torch_device(self, local_rank: int = 0):
        import torch

        return torch.device(self.device_type if self.device_type == "cpu" else f"{self.device_type}:{local_rank}")

    def synchronize(self) -> None:
        pass

    def set_device(self, device) -> None:
        """Make ``device`` this process's current device (one process per device)."""

    def init_process(self) -> None:
        """Process-wide tuning done once by the worker before the model is built."""

    def after_load(self, weights: Sequence[torch.Tensor] = ()) -> None:
        """Process-wide tuning done once by the worker after the weights and caches are allocated;
        ``weights``: the tensors the worker holds as weights (parameters, kernels' repacked ones)."""

    def release(self) -> None:
        """A worker that ran after_load() is gone (shut down, or collected): undo the tuning once
        the process has no other."""

    def step_threads(self, world_size: int):
        """Called once by the worker in the thread that built the model, after building it. ->
        None, or a callable the worker wraps each model step in, in the thread that runs it
        (``with step_threads(num_tokens): ...``): CPU picks its OpenMP thread count from step
        times there (platforms/cpu/runtime/threads.py). ``world_size``: ranks of this engine."""
        return None

    def memory_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device."""
        raise NotImplementedError

    def memory_meter(self):
        """-> MemoryMeter (platforms/memory_meter.py): the peak the worker's profile step takes."""
        from tengyun.platforms.memory_meter import TorchAllocatorMeter

        return TorchAllocatorMeter(self.device_type)

    def keep_rng_state(self, device):
        """A context that gives the host's and ``device``'s random generators back their state on
        exit: a step run to measure (the profile step samples) must not shift a seeded run's draws."""
        import torch

        return torch.random.fork_rng(devices=[device], device_type=self.device_type)

    def smi_device_ids(self) -> list[int]:
        """Ids of every device this host's smi tool lists (nvidia-smi, npu-smi), for `tengyun
        launch`; [] when there is none or it fails. Never initialises a device."""
        return []

    def memory_usage(self, pid: int) -> tuple[int, int] | None:
        """(used, total) bytes of the memory server process ``pid`` fills, for `tengyun supervise`:
        the fullest of its visible devices, or on CPU its process tree's RSS against host RAM;
        None when it cannot be read. Never initialises a device in the calling process."""
        return None

    def device_readings(self) -> list:
        """[DeviceReading] (tengyun/host/telemetry.py) of the devices this server uses on this host,
        for the /metrics device gauges and /health/detail; [] when nothing is readable. Called
        by the server's sampler thread, never on a step: it may run npu-smi / nvidia-smi, but
        never initialises a device in the calling process."""
        return []

    def link_status(self) -> dict[str, str] | None:
        """{device: "UP" | "DOWN" | "unknown"} of the collective-communication links where a tool
        reports them (NPU: hccn_tool); None where there is no such tool."""
        return None

    def capture_graph(self, forward, state=(), first=True):
        """Record ``forward() -> Tensor`` once; return a function that replays it and returns its
        output tensor (the same one, values updated, or a fresh one); None where this batch size
        cannot be recorded (it then runs eager). ``state``: the tensors forward writes in place
        (caches), for a recorder that must know them. ``first``: the first size of the model's
        captures (later ones may skip warming up what is built once per model). Only where
        supports_graphs."""
        raise NotImplementedError(f"{self.device_type} has no graph capture")

    def graph_batch_limit(self, kernels) -> int:
        """The largest decode batch worth a graph with these kernels (KernelBundle); 0: none."""
        return 512  # vLLM's default capture limit

    def graph_blocker(self, tp_size: int) -> str | None:
        """Why decode graphs cannot run at this tensor-parallel size here (None: they can)."""
        return None

    # ----- kernels: chosen from each platform's ordered candidates (kernel_choice.py) -------------
    @classmethod
    def kernel_candidates(cls, kind: str) -> list[KernelCandidate]:
        """The candidates for op ``kind`` (kernel_choice.KINDS), best first, the last one always
        able: here the plain-PyTorch kernels. A platform prepends its own."""
        return list(_TORCH_CANDIDATES[kind])

    @classmethod
    def choose_kernel(cls, kind: str, query: KernelQuery) -> Choice:
        """The first of ``kind``'s candidates that can run ``query``; what the worker builds and
        what `tengyun plan` counts. The debug log says why each earlier candidate could not."""
        choice = choose(kind, cls.kernel_candidates(kind), query)
        logging.getLogger(cls.__module__).debug("Kernel choice %s: %s", kind, choice.explain())
        return choice

    def kernels(self, dtype, block_size: int | None = None, kv_cache_dtype: str | None = None,
                linear_attention: bool = False, quant_schemes=()):
        """Everything the model's layers compute through here, chosen once per worker and bound
        in one pass (``tengyun.layers.kernels.bind_kernels``): the attention backend for KV blocks
        of ``block_size`` tokens in ``kv_cache_dtype``, the linear kernel for weights of ``dtype``
        (torch.dtype), a kernel per quantised scheme in ``quant_schemes`` (LinearScheme), the
        norm/rotary ops, the sampler's fused draw and, where the model has Gated DeltaNet layers
        (``linear_attention``), the gated-delta-rule kernel. -> KernelBundle"""
        from tengyun.layers.kernels import KernelBundle
        from tengyun.platforms.attention_backends import get_attention_backend

        bundle = KernelBundle(
            attention=get_attention_backend(self.attention_backend(block_size, kv_cache_dtype)),
            linear=self.linear_kernel(dtype), layer_ops=self.layer_ops(),
            gated_delta_rule=self.gated_delta_rule_kernel() if linear_attention else None,
            quant_linear={scheme: self.quant_linear_kernel(scheme, dtype) for scheme in quant_schemes},
            sample_rows=self.sample_rows_kernel(),
            lora=self._build("lora", KernelQuery(dtype_name(dtype))), moe=self.moe_kernel(dtype))
        quantised = ", ".join(f"{scheme.description}: {type(kernel).__name__}"
                              for scheme, kernel in bundle.quant_linear.items())
        logging.getLogger(type(self).__module__).info(
            "Kernels: linear %s, layer ops %s, sampler %s, MoE %s%s (why each: VLLM_LOGGING_LEVEL=DEBUG)",
            type(bundle.linear).__name__, type(bundle.layer_ops).__name__,
            "PyTorch" if bundle.sample_rows is None else "compiled", bundle.moe.name,
            f", quantised {quantised}" if quantised else "")
        return bundle

    # Each kind's choice, built; ``kernels`` bundles them.
    def attention_backend(self, block_size: int | None = None, kv_cache_dtype: str | None = None) -> str:
        """The attention backend's name (tengyun/platforms/attention_backends.py) for KV blocks of
        ``block_size`` tokens in ``kv_cache_dtype`` ("bfloat16", ...); one log line says which and why."""
        query = KernelQuery(kv_cache_dtype or "", block_size=block_size, kv_cache_dtype=kv_cache_dtype)
        choice = self.choose_kernel("attention", query)
        logging.getLogger(type(self).__module__).info("Attention backend: %s (%s)", choice.name, choice.detail(query))
        return choice.name

    def gated_delta_rule_kernel(self):
        """The kernel Gated DeltaNet layers on this device run (tengyun/layers/gated_delta_rule.py)."""
        return self._build("gated_delta_rule", KernelQuery(""))

    def linear_kernel(self, dtype):
        """The matmul kernel for linear layers of ``dtype`` (torch.dtype)."""
        return self._build("linear", KernelQuery(dtype_name(dtype)))

    def quant_linear_kernel(self, scheme, dtype):
        """The kernel for linear layers quantised as ``scheme`` (tengyun/quantization/scheme.py
        LinearScheme) with activations in ``dtype`` (torch.dtype)."""
        return self._build("quant_linear", KernelQuery(dtype_name(dtype), scheme=scheme))

    def sample_rows_kernel(self):
        """The sampler's fused last stage (KernelBundle.sample_rows), or None: PyTorch's ops."""
        return self._build("sampler", KernelQuery(""))

    def moe_kernel(self, dtype):
        """How MoE layers' dense experts compute (tengyun/layers/moe/grouped.py), weights of ``dtype``."""
        return self._build("moe", KernelQuery(dtype_name(dtype)))

    def layer_ops(self):
        """How RMSNorm and rotary embedding compute (tengyun/layers/layer_ops.py)."""
        return self._build("layer_ops", KernelQuery(""))

    def _build(self, kind: str, query: KernelQuery):
        return self.choose_kernel(kind, query).candidate.build(query)

    @classmethod
    def quantized_weight_bytes(cls, scheme, out: int, in_: int, dtype: str, in_total: int | None = None) -> int:
        """Bytes one rank's quant_linear kernel holds for an ``out`` x ``in_`` layer quantised as
        ``scheme`` served in ``dtype`` ("bfloat16"): the chosen candidate's nbytes, what `tengyun
        plan` counts. Torch-free where the candidates' checks are."""
        query = KernelQuery(dtype, scheme=scheme)
        return choose("quant_linear", cls.kernel_candidates("quant_linear"), query).candidate.nbytes(
            query, out, in_, in_total)

    @classmethod
    def quantized_head(cls, scheme, dtype: str) -> str | None:
        """How an LM head stored quantised as ``scheme`` (a GGUF's output / tied token_embd) is held
        when served in ``dtype``: "rows" (its kernel streams the blocks and its copy serves a tied
        embedding's lookups), "kernel" (streams them; a tied embedding keeps its blocks), None
        (dequantized once at bind: dense). What `tengyun plan` counts (embed_head.py does it).
        Torch-free. Here: dense, except a W8A8 head, whose activations are quantised too: it keeps
        its kernel (the reference where the platform has none)."""
        return "kernel" if scheme.quantises_activations else None

    @classmethod
    def settings_problem(cls, block_size: int, dtype: str, kv_cache_dtype: str) -> str | None:
        """Why this platform's kernels cannot run the resolved --block-size, --dtype and
        --kv-cache-dtype (canonical names, "auto" resolved), naming the flag and a value to use;
        None when they can. Torch-free: `tengyun plan` asks it for a device it is not on."""
        return None


def fullest_device(usage_mib: dict[int, tuple[int, int]], visible: str | None) -> tuple[int, int] | None:
    """{device: (used MiB, total MiB)} limited to ``visible`` ("2,3"; all when unset) -> the
    (used, total) bytes of the device with the largest used fraction."""
    if visible and all(v.strip().isdigit() for v in visible.split(",")):
        usage_mib = {d: u for d, u in usage_mib.items() if str(d) in {v.strip() for v in visible.split(",")}}
    pairs = [(used, total) for used, total in usage_mib.values() if total]
    if not pairs:
        return None
    used, total = max(pairs, key=lambda p: p[0] / p[1])
    return used << 20, total << 20


def torch_memory_readings(device_type: str) -> list:
    """[DeviceReading] of this process's current ``device_type`` device ("cuda", "npu") from its
    runtime's mem_get_info, only where this process already initialised it; else []."""
    import sys

    from tengyun.host.telemetry import DeviceReading

    torch = sys.modules.get("torch")
    runtime = getattr(torch, device_type, None) if torch is not None else None
    if runtime is None or not getattr(runtime, "is_initialized", lambda: False)():
        return []
    index = runtime.current_device()
    free, total = runtime.mem_get_info(index)
    return [DeviceReading(f"{device_type}:{index}", total - free, total, None, source="torch")]


def _torch_attention(query: KernelQuery):
    return "torch_sdpa"  # a name: attention_backend returns names (attention_backends.py builds them)


def _torch_gated_delta_rule(query: KernelQuery):
    from tengyun.layers.gated_delta_rule import TorchGatedDeltaRule

    return TorchGatedDeltaRule()


def _torch_lora(name: str):
    def build(query: KernelQuery):
        from tengyun.layers.lora.kernels import TORCH_LORA_KERNELS

        return TORCH_LORA_KERNELS[name]()

    return build


def _dense_linear(query: KernelQuery):
    from tengyun.layers.linear_kernel import DenseLinearKernel

    return DenseLinearKernel()


def _reference_quant_linear(query: KernelQuery):
    from tengyun.layers.quant_kernels import reference_kernel

    return reference_kernel(query.scheme)


def reference_quant_bytes(query: KernelQuery, out: int, in_: int, in_total: int | None) -> int:
    """The checkpoint's tensors as stored (LinearScheme.nbytes), scales in the served dtype."""
    return query.scheme.nbytes(out, in_, DTYPE_BYTES[query.dtype], in_total)


def why_not_grouped_mm(query: KernelQuery) -> str | None:
    """torch._grouped_mm exists (torch 2.8 or later); the CPU's takes every float dtype."""
    import torch

    return None if hasattr(torch, "_grouped_mm") else "this torch has no torch._grouped_mm (2.8 or later)"


def _why_not_bf16_grouped_mm(query: KernelQuery) -> str | None:
    """CUDA's torch._grouped_mm takes bfloat16 only (and rows aligned to 16 bytes: hidden and
    moe_intermediate_size multiples of 8, as released models have)."""
    if query.dtype != "bfloat16":
        return f"torch._grouped_mm on a GPU takes bfloat16 only, not {query.dtype}"
    return why_not_grouped_mm(query)


def torch_grouped_moe(query: KernelQuery):
    from tengyun.layers.moe.grouped import TorchGroupedMoe

    return TorchGroupedMoe()


def _torch_loop_moe(query: KernelQuery):
    from tengyun.layers.moe.grouped import LoopMoe

    return LoopMoe()


def _torch_layer_ops(query: KernelQuery):
    from tengyun.layers.layer_ops import TORCH_LAYER_OPS

    return TORCH_LAYER_OPS


# The plain-PyTorch kernels: every platform's last candidate of each kind (they run anywhere).
REFERENCE_QUANT_LINEAR = KernelCandidate("reference", always, _reference_quant_linear, nbytes=reference_quant_bytes,
                                         describe=lambda q: "plain PyTorch, dequantizing per call")
_TORCH_CANDIDATES: dict[str, tuple[KernelCandidate, ...]] = {
    "attention": (KernelCandidate("torch_sdpa", always, _torch_attention, describe=lambda q: "plain PyTorch"),),
    "linear": (KernelCandidate("dense", always, _dense_linear),),
    "quant_linear": (REFERENCE_QUANT_LINEAR,),
    "layer_ops": (KernelCandidate("torch", always, _torch_layer_ops),),
    "sampler": (KernelCandidate("torch", always, lambda q: None),),
    "gated_delta_rule": (KernelCandidate("torch", always, _torch_gated_delta_rule),),
    # LoRA's batched products (layers/lora/kernels.py): two GEMMs whatever the adapters' mix
    "lora": (KernelCandidate("masked_dense", always, _torch_lora("masked_dense")),),
    # torch._grouped_mm (as a GPU's takes it): no host sync; the per-expert loop reads the counts on the host.
    "moe": (KernelCandidate("torch_grouped_mm", _why_not_bf16_grouped_mm, torch_grouped_moe),
            KernelCandidate("torch_loop", always, _torch_loop_moe)),
}
