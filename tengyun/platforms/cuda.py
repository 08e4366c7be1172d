from __future__ import annotations

import functools
import logging
import os

from tengyun.platforms.base import Platform, fullest_device

logger = logging.getLogger(__name__)


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
        if not self.is_available():
            raise RuntimeError(
                "--device cuda was requested but torch.cuda.is_available() is False: install a CUDA "
                "build of torch and check the NVIDIA driver (nvidia-smi), or pass --device cpu."
            )

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def set_device(self, device) -> None:
        import torch

        torch.cuda.set_device(device)

    def capture_graph(self, forward):
        """CUDA graph: warm up on a side stream (lazy init, autotuning), then capture; all graphs
        share one memory pool, captured largest batch first so smaller ones fit inside it."""
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
        from tengyun.layers.attention.flash_attn import PAGE_BLOCK_MULTIPLE, flash_attn_import_error

        return PAGE_BLOCK_MULTIPLE if flash_attn_import_error() is None else 16

    def attention_backend(self, block_size: int | None = None, kv_cache_dtype: str | None = None) -> str:
        """flash_attn when it imports and takes this cache, else torch_sdpa; one log line says
        which and why."""
        reason = _why_not_flash_attn(block_size, kv_cache_dtype)
        if reason:
            logger.info("Attention backend: torch_sdpa (%s)", reason)
            return "torch_sdpa"
        logger.info("Attention backend: flash_attn (block size %d, %s KV cache)", block_size, kv_cache_dtype)
        return "flash_attn"

    def gated_delta_rule_kernel(self):
        """flash-linear-attention's Triton kernels when fla imports, else the PyTorch kernel."""
        if _fla_import_error() is not None:
            return super().gated_delta_rule_kernel()
        from tengyun.layers.gated_delta_rule_fla import FlaGatedDeltaRule

        return FlaGatedDeltaRule()

    def memory_info(self) -> tuple[int, int]:
        import torch

        return torch.cuda.mem_get_info()

    def smi_device_ids(self) -> list[int]:
        from tengyun.ops import probe, smi

        out = probe.nvidia_smi_memory()
        return sorted(smi.parse_nvidia_memory(out.stdout)) if out and out.returncode == 0 else []

    def memory_usage(self, pid: int) -> tuple[int, int] | None:
        from tengyun.ops import probe, smi

        out = probe.nvidia_smi_memory()
        if out is None or out.returncode != 0:
            return None
        return fullest_device(smi.parse_nvidia_memory(out.stdout), os.environ.get(self.visible_devices_env))


def _why_not_flash_attn(block_size: int | None, kv_cache_dtype: str | None) -> str | None:
    from tengyun.layers.attention.flash_attn import CACHE_DTYPES, PAGE_BLOCK_MULTIPLE, flash_attn_import_error

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
