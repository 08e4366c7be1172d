"""Platform selection. Only this package knows device names."""

from __future__ import annotations

from tengyun.dtypes import canonical_dtype
from tengyun.platforms.base import Platform


def current_platform_type(requested: str = "auto") -> str:
    """'auto' -> the first of npu, cuda, cpu that works here; an explicit request must work."""
    return get_platform(requested).device_type


def get_platform(requested: str = "auto") -> Platform:
    if requested != "auto":
        platform = platform_class(requested)()
        platform.check_available()
        return platform
    for device_type in ("npu", "cuda"):
        if platform_class(device_type).is_available():
            return platform_class(device_type)()
    return platform_class("cpu")()


def platform_class(device_type: str) -> type[Platform]:
    """"cpu" | "cuda" | "npu" -> its Platform class, for class attributes without touching the device."""
    from tengyun.platforms.cpu.platform import CpuPlatform
    from tengyun.platforms.cuda.platform import CudaPlatform
    from tengyun.platforms.npu.platform import NpuPlatform

    return {"npu": NpuPlatform, "cuda": CudaPlatform, "cpu": CpuPlatform}[device_type]


def served_dtype(requested: str, device_type: str, checkpoint_dtype: str | None) -> str:
    """--dtype on ``device_type`` ("cpu", "cuda", "npu"): an explicit dtype as given (aliases
    resolved); "auto" as that platform serves a checkpoint stored in ``checkpoint_dtype``
    (ModelSpec.checkpoint_dtype; Platform.auto_dtype). The engine and `tengyun plan` both ask here."""
    requested = canonical_dtype(requested)
    return platform_class(device_type).auto_dtype(checkpoint_dtype) if requested == "auto" else requested
