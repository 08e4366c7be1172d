from __future__ import annotations

import torch
from torch import nn

from tengyun.layers.kernels import KernelBundle
from tengyun.layers.layer_ops import TORCH_LAYER_OPS, TorchLayerOps


class SiluAndMul(nn.Module):
    """[N, 2d] -> [N, d]: silu(x[:, :d]) * x[:, d:] (gate_up packs gate first), through the bound
    layer ops (PyTorch until ``bind_kernels``)."""

    def __init__(self):
        super().__init__()
        self.ops: TorchLayerOps = TORCH_LAYER_OPS

    def bind_kernels(self, kernels: KernelBundle) -> None:
        self.ops = kernels.layer_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)
