from __future__ import annotations

import importlib.util

from tengyun.platforms.base import Platform


class NpuPlatform(Platform):
    device_type = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"

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

    def memory_info(self) -> tuple[int, int]:
        import torch

        return torch.npu.mem_get_info()
