"""Platform selection. Only this package knows device names."""

from __future__ import annotations

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
    from tengyun.platforms.cpu import CpuPlatform
    from tengyun.platforms.cuda import CudaPlatform
    from tengyun.platforms.npu import NpuPlatform

    return {"npu": NpuPlatform, "cuda": CudaPlatform, "cpu": CpuPlatform}[device_type]
