"""RMSNorm and rotary embedding through torch_npu's fused ops.

NOT YET RUN ON HARDWARE: written against the documented torch_npu APIs and tested on CPU
against a reference of those documented semantics (tests/platforms/fake_torch_npu.py).

- ``npu_rms_norm(x, gamma, epsilon) -> (y, rstd)`` and ``npu_add_rms_norm(x1, x2, gamma,
  epsilon) -> (y, rstd, x1 + x2)``: normalise in float32, return x's dtype; gamma must have
  x's dtype, so Qwen3.5's 1 + w is computed once in float32 and rounded to the model dtype.
- ``npu_rotary_mul(x, r1, r2)`` (rotary_mode "half", the neox layout): x [B, S, N, D] read as
  BSND with r1 = cos, r2 = sin [1, S, 1, D] in x's dtype. The A2/A3 docs ask for D even and
  under 896, N under 1000 and r1, r2 within [-1, 1]; a partial rotary (Qwen3.5) passes only
  its rotated channels, so D is rotary_dim. YaRN scales cos and sin past 1: that rotary stays
  on PyTorch (``rotary_fits``).
"""

from __future__ import annotations

import importlib

import torch

from tengyun.layers.layer_ops import TorchLayerOps

_MAX_ROTARY_DIM = 896  # npu_rotary_mul: D < 896


class NpuLayerOps(TorchLayerOps):
    def __init__(self):
        self.npu = importlib.import_module("torch_npu")

    def norm_weight(self, weight: torch.Tensor, offset: float) -> torch.Tensor:
        return weight if not offset else (offset + weight.float()).to(weight.dtype)

    def rms_norm(self, x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
        return self.npu.npu_rms_norm(x, gamma, eps)[0]

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        y, _, added = self.npu.npu_add_rms_norm(x, residual, gamma, eps)
        return y, added

    def rotary_fits(self, rotary_dim: int, scale: float) -> bool:
        return rotary_dim % 2 == 0 and rotary_dim < _MAX_ROTARY_DIM and abs(scale) <= 1.0

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # cos, sin [T, 1, R / 2] float32 -> r1, r2 [1, T, 1, R]: both halves turn by the same angle
        r1 = torch.cat((cos, cos), dim=-1).to(q.dtype).unsqueeze(0)
        r2 = torch.cat((sin, sin), dim=-1).to(q.dtype).unsqueeze(0)
        q = self.npu.npu_rotary_mul(q.contiguous().unsqueeze(0), r1, r2)[0]  # [1, T, Hq, R] -> [T, Hq, R]
        k = self.npu.npu_rotary_mul(k.contiguous().unsqueeze(0), r1, r2)[0]
        return q, k
