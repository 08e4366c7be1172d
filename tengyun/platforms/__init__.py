"""Platform selection. Only this package knows device names."""

from __future__ import annotations

from tengyun.platforms.base import Platform


def current_platform_type(requested: str = "auto") -> str:
    """'auto' -> the first of npu, cuda, cpu that works here; an explicit request must work."""
    return get_platform(requested).device_type


def get_platform(requested: str = "auto") -> Platform:
    from tengyun.platforms.cpu import CpuPlatform
    from tengyun.platforms.cuda import CudaPlatform
    from tengyun.platforms.npu import NpuPlatform

    candidates = {"npu": NpuPlatform, "cuda": CudaPlatform, "cpu": CpuPlatform}
    if requested != "auto":
        platform = candidates[requested]()
        platform.check_available()
        return platform
    for cls in candidates.values():
        if cls.is_available():
            return cls()
    return CpuPlatform()
