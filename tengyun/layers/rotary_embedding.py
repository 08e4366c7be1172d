"""Rotary position embedding (neox layout: the rotated halves are the two halves of head_dim).

Supported rope types, read from config.json's ``rope_parameters`` (transformers >= 5) or
``rope_theta`` + ``rope_scaling`` (older files): default, linear, llama3, yarn.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

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
    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, params: dict[str, Any]):
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        base, kind = float(params["rope_theta"]), params["rope_type"]
        inv_freq = _default_inv_freq(base, rotary_dim)
        scale = 1.0
        if kind == "linear":
            inv_freq = inv_freq / params["factor"]
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif kind == "yarn":
            inv_freq, scale = _yarn_inv_freq(base, rotary_dim, params, max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, rotary_dim / 2] each; float32 whatever the model dtype.
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [T, H, head_dim]; cos/sin [T, 1, rotary_dim / 2]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        x1, x2 = rot.float().chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return rotated if rest.numel() == 0 else torch.cat((rotated, rest), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, Hq * D]; k [T, Hkv * D] -> rotated q, k of the same shapes."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        q = self._rotate(q.view(q.shape[0], -1, self.head_dim), cos, sin).flatten(1)
        k = self._rotate(k.view(k.shape[0], -1, self.head_dim), cos, sin).flatten(1)
        return q, k
