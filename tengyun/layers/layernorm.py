from __future__ import annotations

import torch
from torch import nn

from tengyun.layers.kernels import KernelBundle
from tengyun.layers.layer_ops import TORCH_LAYER_OPS, TorchLayerOps


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 as HF does.

    forward(x, residual) fuses the residual add: returns (norm(x + residual), x + residual).
    The arithmetic is the bound layer ops' (``layer_ops.py``): PyTorch by default, a platform's
    fused kernels once the worker binds them (``bind_kernels``).
    """

    offset = 0.0  # the norm multiplies by offset + weight

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.ops: TorchLayerOps = TORCH_LAYER_OPS
        self.gamma: torch.Tensor | None = None  # offset + weight in the ops' form, set by bind_kernels

    def bind_kernels(self, kernels: KernelBundle) -> None:
        """Use the layer ops from now on; the weight is final (loaded), so gamma is computed once here."""
        self.ops = kernels.layer_ops
        self.gamma = self.ops.norm_weight(self.weight.data, self.offset)

    def _gamma(self) -> torch.Tensor:
        return self.ops.norm_weight(self.weight, self.offset) if self.gamma is None else self.gamma

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self._gamma(), self.eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        return self.ops.add_rms_norm(x, residual, self._gamma(), self.eps)


class ZeroCenteredRMSNorm(RMSNorm):
    """Qwen3.5: y = x / sqrt(mean(x^2) + eps) * (1 + weight), all in float32; weight starts at 0."""

    offset = 1.0

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__(hidden_size, eps, dtype)
        self.weight.data.zero_()


class GatedRMSNorm(RMSNorm):
    """Gated DeltaNet output norm: rms_norm(x) * weight, then * silu(gate) in float32.

    The norm goes through the bound layer ops; the silu gate stays PyTorch on every platform (the
    layer ops have no gated norm)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return (self._norm(x).float() * torch.nn.functional.silu(gate.float())).to(x.dtype)
