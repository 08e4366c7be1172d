"""Attention backends by name: the name ``Platform.attention_backend`` picks -> an instance."""

from __future__ import annotations

from tengyun.layers.attention.backend import AttentionBackend
from tengyun.layers.attention.flash_attn import FlashAttnBackend
from tengyun.layers.attention.npu_attention import NpuAttentionBackend
from tengyun.layers.attention.torch_sdpa import TorchSDPABackend

# Importing a backend's module never imports its library (flash_attn, torch_npu): that happens
# at its first call, so every backend is listed whatever is installed.
BACKENDS: dict[str, type[AttentionBackend]] = {
    cls.name: cls for cls in (TorchSDPABackend, NpuAttentionBackend, FlashAttnBackend)
}


def get_attention_backend(name: str) -> AttentionBackend:
    """"torch_sdpa" | "npu" | "flash_attn" -> a new backend of that name."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
    return BACKENDS[name]()
