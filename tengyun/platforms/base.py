"""The small interface every device platform implements."""

from __future__ import annotations


class Platform:
    device_type: str = ""
    dist_backend: str = ""
    visible_devices_env: str = ""

    @classmethod
    def is_available(cls) -> bool:
        raise NotImplementedError

    def check_available(self) -> None:
        """Raise a RuntimeError that says what to install or source when the device is unusable."""
        if not self.is_available():
            raise RuntimeError(f"--device {self.device_type} was requested but is not available.")

    def torch_device(self, local_rank: int = 0):
        import torch

        return torch.device(self.device_type if self.device_type == "cpu" else f"{self.device_type}:{local_rank}")

    def synchronize(self) -> None:
        pass

    def init_process(self) -> None:
        """Process-wide tuning done once by the worker before the model is built."""

    def memory_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device."""
        raise NotImplementedError

    def attention_backend(self) -> str:
        return "torch_sdpa"

    def linear_kernel(self, dtype):
        """The matmul kernel for linear layers of ``dtype`` (torch.dtype)."""
        from tengyun.layers.linear_kernel import DenseLinearKernel

        return DenseLinearKernel()
