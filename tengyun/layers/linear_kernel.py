"""How a linear layer multiplies: plain F.linear, or a platform's faster kernel.

The platform picks the kernel (``Platform.linear_kernel``); layers only call prepare/apply.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# ids [T] -> rows [T, in] of a prepared weight, bit for bit the rows of the weight as loaded
RowReader = Callable[[torch.Tensor], torch.Tensor]


class DenseLinearKernel:
    """y = x W^T + b with W [out, in] as loaded."""

    frees_original = False

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def row_reader(self, prepared, original: torch.Tensor) -> RowReader | None:
        """Reads rows of ``original`` [out, in] from ``prepared`` (its copy), so a tied embedding can
        look tokens up there and the original can be freed; None where this kernel cannot."""
        return None


class OneDNNPackedLinearKernel(DenseLinearKernel):
    """oneDNN with the weight reordered once into its blocked layout (CPU, fp32/bf16).

    Faster than F.linear at SmolLM2's shapes on this 2-core CPU, most at small row counts
    (benchmarks/linear_kernels.py; figures in benchmarks/README.md).
    """

    frees_original = True

    def __init__(self, batch_size_hint: int = 64):
        self.batch_size_hint = batch_size_hint

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), self.batch_size_hint)

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def onednn_available(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:  # the private op must exist and agree with F.linear on this build
        w, x = torch.randn(8, 4, dtype=dtype), torch.randn(3, 4, dtype=dtype)
        kernel = OneDNNPackedLinearKernel()
        return torch.allclose(kernel.apply(x, kernel.prepare(w), None), F.linear(x, w), atol=1e-2)
    except (RuntimeError, AttributeError):
        return False
