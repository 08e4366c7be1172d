"""How quantised linear layers multiply: the plain-PyTorch reference of each kernel kind.

A kernel takes the layer's loaded tensors by their checkpoint names (scheme.py), prepares them
once (``prepare``, which may repack; ``frees_original`` then drops the loaded ones) and computes
y = x W^T + b from the prepared dict (``apply``). Platforms pick faster kernels with the same
arithmetic (Platform.quant_linear_kernel: tengyun/platforms/cpu_quant.py, npu_quant.py); these
references run wherever nothing faster exists (and on CUDA), and define what the others must
match.

    w8a8_int8: s_x = max|x_t| / 127 per token t, x_q = round(x / s_x) in int8,
               y = (x_q @ w_q^T) * s_x * s_w   (int32 sums; vLLM's dynamic per-token scheme)
    wna16_int: w = (q - zero) * scale per group of input features, y = x @ w^T
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tengyun.quantization.packing import dequantize, unpack_int32
from tengyun.quantization.scheme import LinearScheme

Tensors = dict[str, torch.Tensor]


class QuantLinearKernel:
    frees_original = False  # prepare returns new tensors: the layer drops its loaded ones

    def __init__(self, scheme: LinearScheme):
        self.scheme = scheme

    def prepare(self, tensors: Tensors) -> Tensors:
        return tensors

    def apply(self, x: torch.Tensor, prepared: Tensors, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q int8 [M, K], s_x float32 [M, 1]) with x ~ x_q * s_x, symmetric."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-10).div_(127.0)
    return torch.clamp(torch.round(xf / scale), -128, 127).to(torch.int8), scale


class ReferenceW8A8Kernel(QuantLinearKernel):
    """weight int8 [out, in], weight_scale [out, 1]. The int32 sums run as float32 here: exact
    while |sum| < 2^24 (faster kernels sum in int32)."""

    def apply(self, x, prepared, bias):
        x2 = x.reshape(-1, x.shape[-1])
        x_q, s_x = quantize_per_token(x2)
        acc = x_q.float() @ prepared["weight"].float().t()  # [M, out]
        y = (acc * s_x * prepared["weight_scale"].float().t()).to(x.dtype)
        y = y.reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


def unpacked_weight(prepared: Tensors, scheme: LinearScheme) -> tuple[torch.Tensor, torch.Tensor | None]:
    """compressed-tensors pack-quantized -> (q int8 [out, in], zero int8 [out, in / group] or None)."""
    bits = scheme.weight_bits
    q = unpack_int32(prepared["weight_packed"], bits, dim=1)
    zero = prepared.get("weight_zero_point")
    return q, (None if zero is None else unpack_int32(zero, bits, dim=0))


class ReferenceWNA16Kernel(QuantLinearKernel):
    """weight_packed int32 [out, in * bits / 32], weight_scale [out, in / group] (zero point
    [out * bits / 32, in / group] when asymmetric): dequantized in x's dtype at every call."""

    def apply(self, x, prepared, bias):
        q, zero = unpacked_weight(prepared, self.scheme)
        return F.linear(x, dequantize(q, prepared["weight_scale"], zero, x.dtype), bias)


REFERENCE_KERNELS = {"w8a8_int8": ReferenceW8A8Kernel, "wna16_int": ReferenceWNA16Kernel}


def reference_kernel(scheme: LinearScheme) -> QuantLinearKernel:
    if scheme.kernel.startswith("gguf_"):  # GGUF kept quantised: gguf_kernels.py
        from tengyun.layers.gguf_kernels import GgufReferenceKernel

        return GgufReferenceKernel(scheme)
    return REFERENCE_KERNELS[scheme.kernel](scheme)
