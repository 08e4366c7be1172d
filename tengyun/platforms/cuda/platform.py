from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import logging
import os
import re
import sys
from pathlib import Path

from tengyun.platforms.kernel_choice import KernelCandidate, KernelQuery
from tengyun.platforms.base import Platform, fullest_device, torch_memory_readings
from tengyun.platforms.startup import DeviceStartupError, RuntimeProblem

logger = logging.getLogger(__name__)


def torch_cuda_version() -> str | None:
    """torch.version.cuda (None: a build without CUDA), read from torch/version.py when torch is not
    imported yet: platform selection in the API process then leaves torch to the engine process it
    forks (a CPU server's API process holds ~200 MiB less; tengyun/engine/engine_process.py)."""
    if "torch" in sys.modules:
        return sys.modules["torch"].version.cuda
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or ()) if spec else ():
        try:
            match = re.search(r"^cuda\b[^=\n]*=\s*(.+)$", (Path(folder) / "version.py").read_text(), re.MULTILINE)
            return ast.literal_eval(match.group(1).strip())
        except (AttributeError, OSError, ValueError, SyntaxError):  # a layout this does not know
            break
    import torch  # no torch (ImportError), or asked of torch itself

    return torch.version.cuda


class CudaPlatform(Platform):
    device_type = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    supports_graphs = True
    fp8_matmul = False  # Hopper and later have FP8 GEMMs, but no linear kernel here calls them yet

    def __init__(self):
        self._graph_pool = None  # one memory pool shared by every captured graph


    @classmethod
    def is_available(cls) -> bool:
        import torch

        return torch.cuda.is_available()

    def check_available(self) -> None:
        problem = self.runtime_problem(0)
        if problem is not None:
            raise DeviceStartupError(f"--device cuda was requested but {problem.what}: {problem.fix}.")

    @classmethod
    def runtime_installed(cls) -> bool:
        return torch_cuda_version() is not None

    @classmethod
    def runtime_problem(cls, timeout_s: float) -> RuntimeProblem | None:
        """In this process: torch's CUDA check reads NVML and does not create a context. A torch
        without CUDA is told from its version file, without importing torch."""
        if torch_cuda_version() is None:
            return RuntimeProblem(f"torch {importlib.metadata.version('torch')} is a build without CUDA",
                                  "install a CUDA build of torch (https://pytorch.org/get-started/locally/)",
                                  installed=False)
        import torch

        if not torch.cuda.is_available():
            return RuntimeProblem("torch.cuda.is_available() is False",
                                  "check the NVIDIA driver (`nvidia-smi`) and CUDA_VISIBLE_DEVICES, or pass "
                                  "--device cpu", installed=False)  # a CUDA wheel on a CPU host: a note
        return None

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def set_device(self, device) -> None:
        import torch

        torch.cuda.set_device(device)

    def capture_graph(self, forward, state=(), first=True):
        """CUDA graph: warm up on a side stream (lazy init, autotuning, which is per shape: every
        size warms up, ``first`` or not), then capture; all graphs share one memory pool, captured
        largest batch first so smaller ones fit inside it."""
        import torch

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            output = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay

    @property
    def default_block_size(self) -> int:
        """256 when flash-attn imports (its paged KV needs a multiple of 256), else 16. Pass
        --block-size 16 for finer prefix-cache hits; attention then runs on torch_sdpa."""
        from tengyun.platforms.cuda.kernels.attention import PAGE_BLOCK_MULTIPLE, flash_attn_import_error

        return PAGE_BLOCK_MULTIPLE if flash_attn_import_error() is None else 16

    @classmethod
    def kernel_candidates(cls, kind: str):
        """flash_attn (where it imports and takes the cache) and flash-linear-attention's Triton
        gated delta rule (where fla imports), then the plain-PyTorch ones."""
        return list(_CUDA_CANDIDATES.get(kind, ())) + super().kernel_candidates(kind)

    def memory_info(self) -> tuple[int, int]:
        import torch

        return torch.cuda.mem_get_info()

    def smi_device_ids(self) -> list[int]:
        from tengyun.host import probe, smi

        out = probe.nvidia_smi_memory()
        return sorted(smi.parse_nvidia_memory(out.stdout)) if out and out.returncode == 0 else []

    def memory_usage(self, pid: int) -> tuple[int, int] | None:
        from tengyun.host import probe, smi

        out = probe.nvidia_smi_memory()
        if out is None or out.returncode != 0:
            return None
        return fullest_device(smi.parse_nvidia_memory(out.stdout), os.environ.get(self.visible_devices_env))

    def device_readings(self) -> list:
        """NVML (nvidia-ml-py) when it imports and finds the driver, else nvidia-smi, else this
        process's own device through torch. NVML and nvidia-smi number GPUs in PCI order;
        CUDA_VISIBLE_DEVICES is matched against those numbers (set CUDA_DEVICE_ORDER=PCI_BUS_ID
        so both agree)."""
        from tengyun.host import probe, smi, telemetry

        visible = os.environ.get(self.visible_devices_env)
        readings = nvml_readings(visible)
        if readings is None:
            out = probe.nvidia_smi_telemetry()
            if out is not None and out.returncode == 0:
                readings = telemetry.nvidia_readings(smi.parse_nvidia_csv(out.stdout), visible)
        return readings if readings is not None else torch_memory_readings("cuda")


@functools.cache
def _nvml():
    """The pynvml module, initialised once per process; None without nvidia-ml-py or a driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        logger.info("NVML unavailable (%s): device gauges come from nvidia-smi", e)
        return None
    return pynvml


def nvml_readings(visible: str | None) -> list | None:
    """[DeviceReading] of every GPU NVML lists (limited to ``visible`` ids); None without NVML."""
    from tengyun.host.telemetry import DeviceReading, visible_ids

    nvml = _nvml()
    if nvml is None:
        return None
    keep = visible_ids(visible)

    def read(call, *args):  # a value this GPU or driver does not support reads as None
        try:
            return call(*args)
        except nvml.NVMLError:
            return None

    readings = []
    for index in range(nvml.nvmlDeviceGetCount()):
        if keep is not None and index not in keep:
            continue
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = read(nvml.nvmlDeviceGetMemoryInfo, handle)  # .used / .total in bytes
        busy = read(nvml.nvmlDeviceGetUtilizationRates, handle)  # .gpu in percent
        milliwatts = read(nvml.nvmlDeviceGetPowerUsage, handle)
        readings.append(DeviceReading(
            f"cuda:{index}", memory and int(memory.used), memory and int(memory.total),
            busy and busy.gpu / 100.0, read(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
            None if milliwatts is None else milliwatts / 1000.0, None, "nvml"))
    return readings


def _why_not_flash_attn(block_size: int | None, kv_cache_dtype: str | None) -> str | None:
    from tengyun.platforms.cuda.kernels.attention import CACHE_DTYPES, PAGE_BLOCK_MULTIPLE, flash_attn_import_error

    if error := flash_attn_import_error():
        return error
    if block_size is None:
        return "no block size was given to choose by"
    if block_size % PAGE_BLOCK_MULTIPLE:
        return (f"flash-attn's paged KV needs a block size that is a multiple of {PAGE_BLOCK_MULTIPLE}; "
                f"--block-size is {block_size}")
    if kv_cache_dtype not in CACHE_DTYPES:
        return f"flash-attn takes a float16 or bfloat16 KV cache, not {kv_cache_dtype}"
    return None


@functools.cache
def _fla_import_error() -> str | None:
    """Checked and logged once per process (every worker in it asks)."""
    from tengyun.layers.gated_delta_rule_fla import fla_import_error

    error = fla_import_error()
    if error:
        logger.info("Gated delta rule: PyTorch kernel (%s; pip install fla-core for the Triton kernels)", error)
    else:
        logger.info("Gated delta rule: flash-linear-attention's Triton kernels")
    return error


def _flash_attn_why_not(query: KernelQuery) -> str | None:
    return _why_not_flash_attn(query.block_size, query.kv_cache_dtype)


def _fla_why_not(query: KernelQuery) -> str | None:
    error = _fla_import_error()
    return None if error is None else f"{error}; pip install fla-core for the Triton kernels"


def _fla_kernel(query: KernelQuery):
    from tengyun.layers.gated_delta_rule_fla import FlaGatedDeltaRule

    return FlaGatedDeltaRule()


_CUDA_CANDIDATES = {
    "attention": (KernelCandidate("flash_attn", _flash_attn_why_not, lambda q: "flash_attn",
                                  describe=lambda q: f"block size {q.block_size}, {q.kv_cache_dtype} KV cache"),),
    "gated_delta_rule": (KernelCandidate("fla", _fla_why_not, _fla_kernel),),
}
