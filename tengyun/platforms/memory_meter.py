"""The peak memory one model step takes, as the worker's profile step measures it
(worker/memory_profile.py): through the device allocator's statistics where there is a device
(torch.cuda, torch.npu), through the process's resident peak on CPU (cpu/runtime/memory_meter.py)."""

from __future__ import annotations

from typing import Protocol


class MemoryMeter(Protocol):
    name: str  # how it measures, for logs and /health/detail

    def start(self) -> None:
        """From here on: the peak is measured above what is allocated now."""

    def peak(self) -> int | None:
        """Bytes above start()'s level at the highest point since; None: not measurable here."""


class TorchAllocatorMeter:
    """A device's caching allocator (``torch.cuda``, ``torch.npu``: the same API): the most bytes
    its tensors held, which is what a KV cache allocated next must leave room for."""

    def __init__(self, device_type: str):
        import torch

        self.module = getattr(torch, device_type)
        self.name = f"torch.{device_type} allocator peak"
        self.base = 0

    def start(self) -> None:
        self.module.synchronize()
        self.module.reset_peak_memory_stats()
        self.base = self.module.memory_allocated()

    def peak(self) -> int | None:
        self.module.synchronize()
        return max(0, self.module.max_memory_allocated() - self.base)

    def release_cached(self) -> None:
        """Blocks the allocator keeps after the step go back to the device, so that the KV budget's
        'in use' reading (memory_info) does not count them a second time."""
        self.module.empty_cache()
