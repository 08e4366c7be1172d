from __future__ import annotations

import os

from tengyun.platforms.base import Platform


class CpuPlatform(Platform):
    device_type = "cpu"
    dist_backend = "gloo"
    visible_devices_env = ""

    @classmethod
    def is_available(cls) -> bool:
        return True

    def linear_kernel(self, dtype):
        from tengyun.layers.linear_kernel import DenseLinearKernel, OneDNNPackedLinearKernel, onednn_available

        return OneDNNPackedLinearKernel() if onednn_available(dtype) else DenseLinearKernel()

    def memory_info(self) -> tuple[int, int]:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return free, pages
