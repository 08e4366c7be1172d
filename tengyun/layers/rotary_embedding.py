"""Rotary position embedding (neox layout: the rotated halves are the two halves of head_dim).

Supported rope types, read from config.json's ``rope_parameters`` (transformers >= 5) or
``rope_theta`` + ``rope_scaling`` (older files): default, linear, llama3, yarn.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tengyun.layers.kernels import KernelBundle
from tengyun.layers.layer_ops import TORCH_LAYER_OPS, TorchLayerOps

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """One dict with rope_type and rope_theta, whichever config.json layout holds them."""
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {params['rope_type']!r} in config.json is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    return params


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(base: float, dim: int, p: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    factor = p["factor"]
    original = p.get("original_max_position_embeddings") or max_position
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = _yarn_mscale(factor, p["mscale"]) / _yarn_mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1 / pos_freqs) * extrapolation_weight
    return inv_freq, attention_factor


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` channels of each head (all of them unless partial, as
    Qwen3.5's 64 of 256) through the bound layer ops (``layer_ops.py``); the rest pass through."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, params: dict[str, Any]):
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        base, kind = float(params["rope_theta"]), params["rope_type"]
        inv_freq = _default_inv_freq(base, rotary_dim)
        self.scale = 1.0  # YaRN's attention factor, folded into cos and sin
        if kind == "linear":
            inv_freq = inv_freq / params["factor"]
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif kind == "yarn":
            inv_freq, self.scale = _yarn_inv_freq(base, rotary_dim, params, max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, rotary_dim / 2] each; float32 whatever the model dtype.
        self.register_buffer("cos", freqs.cos() * self.scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * self.scale, persistent=False)
        self.ops: TorchLayerOps = TORCH_LAYER_OPS

    def bind_kernels(self, kernels: KernelBundle) -> None:
        """Use the layer ops from now on, or stay on PyTorch where they do not take this rotary."""
        ops = kernels.layer_ops
        self.ops = ops if ops.rotary_fits(self.rotary_dim, self.scale) else TORCH_LAYER_OPS

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, Hq * D]; k [T, Hkv * D] -> rotated q, k of the same shapes."""
        q = q.view(q.shape[0], -1, self.head_dim)
        k = k.view(k.shape[0], -1, self.head_dim)
        r = self.rotary_dim
        q_rot, k_rot = self.ops.rotary_at(q[..., :r], k[..., :r], self.cos, self.sin, positions)
        if r < self.head_dim:
            q_rot, k_rot = torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
        return q_rot.flatten(1), k_rot.flatten(1)
