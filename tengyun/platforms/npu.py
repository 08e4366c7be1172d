from __future__ import annotations

import importlib.util
import os

from tengyun.platforms.base import Platform, fullest_device, torch_memory_readings


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

    def device_readings(self) -> list:
        """npu-smi (HBM, AI Core use, temperature, power, health per visible chip), else this
        process's own device through torch_npu's mem_get_info."""
        from tengyun.ops import probe, smi, telemetry

        out = probe.npu_smi_info()
        if out is not None and out.returncode == 0:
            readings = telemetry.npu_readings(smi.parse_npu_smi_info(out.stdout),
                                              os.environ.get(self.visible_devices_env))
            if readings:
                return readings
        return torch_memory_readings("npu")

    def link_status(self) -> dict[str, str] | None:
        """`hccn_tool -i N -link -g` for each visible device: {"npu:N": "UP" | "DOWN" | "unknown"};
        None when hccn_tool is not installed."""
        from tengyun.ops import probe, smi, telemetry

        if probe.hccn_tool() is None:
            return None
        ids = telemetry.visible_ids(os.environ.get(self.visible_devices_env))
        status = {}
        for device in sorted(ids) if ids is not None else self.smi_device_ids():
            out = probe.hccn_link(device)
            if out is None:
                return None
            status[f"npu:{device}"] = (smi.parse_hccn_link(out.stdout) if out.returncode == 0 else None) or "unknown"
        return status
