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
    w8a8_static_int8 (msModelSlim W8A8): x_q = round(x / input_scale + input_offset) in int8 for
               the whole tensor, y = (x_q @ w_q^T + quant_bias) * deq_scale
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tengyun.distributed.parallel_state import get_tp_size
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


class ReferenceW8A8StaticKernel(QuantLinearKernel):
    """msModelSlim static W8A8 (tengyun/quantization/modelslim.py): weight int8 [out, in],
    input_scale / input_offset [1] for the whole activation tensor, deq_scale [out] (float32, or
    int64 holding float32 bits), quant_bias int32 [out] (the float bias folded in; ``bias`` is
    not added again). x_q = clamp(round(x * (1 / input_scale) + input_offset)), y = (x_q @ w^T +
    quant_bias) * deq_scale; sums in float32 here, exact while |sum| < 2^24."""

    def prepare(self, tensors: Tensors) -> Tensors:
        refuse_tensor_parallel_static_w8a8()
        return {"weight": tensors["weight"], "quant_bias": tensors["quant_bias"],
                "deq_scale": deq_scale_float32(tensors["deq_scale"]),
                "input_scale_reciprocal": 1.0 / tensors["input_scale"].float(),
                "input_offset": tensors["input_offset"].float()}

    def apply(self, x, prepared, bias):
        x2 = x.reshape(-1, x.shape[-1])
        x_q = quantize_per_tensor(x2, prepared["input_scale_reciprocal"], prepared["input_offset"])
        acc = x_q.float() @ prepared["weight"].float().t() + prepared["quant_bias"].float()  # [M, out]
        return (acc * prepared["deq_scale"]).to(x.dtype).reshape(*x.shape[:-1], -1)


def quantize_per_tensor(x: torch.Tensor, scale_reciprocal: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> int8 round(x * scale_reciprocal + offset), both [1] float32 (asymmetric, static)."""
    return torch.clamp(torch.round(x.float() * scale_reciprocal + offset), -128, 127).to(torch.int8)


def deq_scale_float32(deq_scale: torch.Tensor) -> torch.Tensor:
    """msModelSlim's deq_scale [out] -> float32: int64 values hold a float32's bits in their low
    32 bits (0x3C000000 -> 2^-7), float32 as is."""
    if deq_scale.dtype == torch.int64:
        return deq_scale.to(torch.int32).view(torch.float32)
    return deq_scale.float()


def refuse_tensor_parallel_static_w8a8() -> None:
    """quant_bias holds the whole input's zero-point correction, so a row-parallel rank cannot
    add its part: static W8A8 runs unsplit."""
    if get_tp_size() > 1:
        raise ValueError("ModelSlim static W8A8 (quant_bias folds the whole input's zero-point correction) runs "
                         "at --tensor-parallel-size 1: drop --tensor-parallel-size, or serve a W8A8_DYNAMIC export.")


REFERENCE_KERNELS = {"w8a8_int8": ReferenceW8A8Kernel, "wna16_int": ReferenceWNA16Kernel,
                     "w8a8_static_int8": ReferenceW8A8StaticKernel}


def reference_kernel(scheme: LinearScheme) -> QuantLinearKernel:
    return REFERENCE_KERNELS[scheme.kernel](scheme)
