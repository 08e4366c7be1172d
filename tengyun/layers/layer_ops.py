"""How RMSNorm, rotary embedding and SiLU-and-mul compute: plain PyTorch, or a platform's fused ops.

The platform picks the ops (``Platform.layer_ops``, one part of ``Platform.kernels``), the
worker hands them to every layer once weights are loaded (``bind_kernels``, kernels.py), and
layers only call the methods below. Until bound, layers use ``TORCH_LAYER_OPS``, so a model
built outside the worker computes as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchLayerOps:
    """The PyTorch reference, HF's arithmetic: every platform's default."""

    def norm_weight(self, weight: torch.Tensor, offset: float) -> torch.Tensor:
        """The gamma a norm multiplies by, computed once after loading: ``weight`` (offset 0)
        or ``offset + weight`` (Qwen3.5's 1 + w, kept in float32 as HF computes it)."""
        return weight if not offset else offset + weight.float()

    def rms_norm(self, x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., H], gamma [H] -> x / sqrt(mean(x^2) + eps) * gamma in x's dtype, normalised in
        float32. The product is taken in the wider of x's and gamma's dtypes, which is HF's
        rounding for both kinds: a bf16 weight (Llama) multiplies the rounded norm, a float32
        1 + w (Qwen3.5) multiplies before rounding."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (gamma * x32.to(torch.promote_types(x.dtype, gamma.dtype))).to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (rms_norm(x + residual), x + residual); the sum is rounded to x's dtype first."""
        x = x + residual
        return self.rms_norm(x, gamma, eps), x

    def rotary_fits(self, rotary_dim: int, scale: float) -> bool:
        """Whether ``rotary`` takes this rotary width and cos/sin scale (YaRN's attention factor)."""
        return True

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox rotation of the rotated part only: q [T, Hq, R], k [T, Hkv, R]; cos, sin
        [T, 1, R / 2] float32 -> rotated q, k of the same shapes and dtypes, computed in float32.
        A platform's ops may rotate in place: callers use only the returned tensors."""
        return _rotate_neox(q, cos, sin), _rotate_neox(k, cos, sin)

    def rotary_at(self, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rotary`` with token t turned by row positions[t] of the float32 [P, R / 2] tables."""
        return self.rotary(q, k, cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1))

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2d] -> [..., d]: silu(x[..., :d]) * x[..., d:], each op rounded to x's dtype."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def _rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


TORCH_LAYER_OPS = TorchLayerOps()

