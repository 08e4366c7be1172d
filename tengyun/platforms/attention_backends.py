"""Attention backends by name: the name ``Platform.attention_backend`` picks -> an instance."""

from __future__ import annotations

from tengyun.layers.attention.backend import AttentionBackend
from tengyun.platforms.cpu.kernels.attention import CpuPagedBackend
from tengyun.platforms.cuda.kernels.attention import FlashAttnBackend
from tengyun.platforms.npu.kernels.attention import NpuAttentionBackend
from tengyun.layers.attention.torch_sdpa import TorchSDPABackend

# Importing a backend's module never imports its library (flash_attn, torch_npu, the compiled CPU
# kernels): that happens at its first call or construction, so every backend is listed whatever is
# installed or built.
BACKENDS: dict[str, type[AttentionBackend]] = {
    cls.name: cls for cls in (TorchSDPABackend, NpuAttentionBackend, FlashAttnBackend, CpuPagedBackend)
}


def get_attention_backend(name: str) -> AttentionBackend:
    """"torch_sdpa" | "npu" | "flash_attn" | "cpu_paged" -> a new backend of that name."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
    return BACKENDS[name]()
