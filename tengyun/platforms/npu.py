from __future__ import annotations

import importlib.util
import os

from tengyun.platforms.base import Platform, fullest_device


class NpuPlatform(Platform):
    device_type = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    default_block_size = 128  # what the fused paged-attention kernels are tuned for

    def attention_backend(self, block_size: int | None = None, kv_cache_dtype: str | None = None) -> str:
        return "npu"

    def layer_ops(self):
        from tengyun.platforms.npu_ops import NpuLayerOps

        return NpuLayerOps()

    def quant_linear_kernel(self, scheme, dtype):
        from tengyun.platforms.npu_quant import npu_quant_kernel

        return npu_quant_kernel(scheme)

    @classmethod
    def is_available(cls) -> bool:
        if importlib.util.find_spec("torch_npu") is None:
            return False
        try:
            import torch
            import torch_npu  # noqa: F401

            return torch.npu.is_available()
        except Exception:
            return False

    def check_available(self) -> None:
        if importlib.util.find_spec("torch_npu") is None:
            raise RuntimeError(
                "--device npu was requested but torch_npu is not installed: install the torch_npu "
                "build matching your torch and CANN versions, then `source "
                "/usr/local/Ascend/ascend-toolkit/set_env.sh`."
            )
        if not self.is_available():
            raise RuntimeError(
                "--device npu was requested but torch_npu finds no NPU: run `source "
                "/usr/local/Ascend/ascend-toolkit/set_env.sh`, check `npu-smi info`, and check "
                "ASCEND_RT_VISIBLE_DEVICES."
            )

    def synchronize(self) -> None:
        import torch

        torch.npu.synchronize()

    def set_device(self, device) -> None:
        import torch

        torch.npu.set_device(device)

    def memory_info(self) -> tuple[int, int]:
        import torch

        return torch.npu.mem_get_info()

    def smi_device_ids(self) -> list[int]:
        from tengyun.ops import probe, smi

        out = probe.npu_smi_info()
        if out is None or out.returncode != 0:
            return []
        return sorted({d.npu_id for d in smi.parse_npu_smi_info(out.stdout).devices})

    def memory_usage(self, pid: int) -> tuple[int, int] | None:
        from tengyun.ops import probe, smi

        out = probe.npu_smi_info()
        if out is None or out.returncode != 0:
            return None
        usage = {}
        for d in smi.parse_npu_smi_info(out.stdout).devices:  # HBM where the card has it (910B), else DDR
            used, total = (d.hbm_used_mb, d.hbm_total_mb) if d.hbm_total_mb else (d.memory_used_mb, d.memory_total_mb)
            if total:
                usage[d.npu_id] = (used or 0, total)
        return fullest_device(usage, os.environ.get(self.visible_devices_env))
