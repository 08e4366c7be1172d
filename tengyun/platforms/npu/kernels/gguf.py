"""GGUF blocks (tengyun/quantization/gguf.py) through torch_npu's weight-only matmul, served in
bfloat16 or float16.

NOT YET RUN ON HARDWARE: written against the documented torch_npu API and tested on CPU against
a reference of its documented semantics (tests/platforms/fake_torch_npu.py).

``npu_weight_quant_batchmatmul(x, w, antiquant_scale [in / 32, out], antiquant_offset (same),
antiquant_group_size=32)`` = x @ ((w + offset) * scale), w int8 [in, out] (Q8_0) or signed int4
[in, out] packed by ``npu_convert_weight_to_int4pack`` (Q4_0/Q4_1/Q4_K as q - 8). Every type is
w = q * scale + offset_gguf per 32 weights (gguf_kernels.q_scale_offset), so with q - 8 stored
the offset torch_npu adds before scaling is (offset_gguf + 8 * scale) / scale: none for Q4_0 and
Q8_0 (exact), m / d + 8 for Q4_1. A block of scale 0 with an offset (constant: Q4_K sub-blocks
with a 6-bit scale of 0) takes scale |offset| / 2^16 instead, so (q - 8) adds at most 2^-13 of
it, under bf16's rounding. Q6_K (a scale per 16 weights) and float32 activations run the reference;
so does a layer past the op's shape limits (matmul_limits.py: more than 65535 inputs, an int4 N
off 8), and one of more than 65535 outputs (a vocabulary-wide LM head) is split by columns.
"""

from __future__ import annotations

import importlib

import torch

from tengyun.layers.gguf_kernels import GgufReferenceKernel, q_scale_offset
from tengyun.layers.quant_kernels import Tensors
from tengyun.platforms.npu.kernels.matmul_limits import (
    ON_REFERENCE, by_columns, log_fallback, on_reference, single_group, split_columns, weight_problem,
)
from tengyun.quantization.scheme import LinearScheme

GROUP = 32


class NpuGgufKernel(GgufReferenceKernel):
    frees_original = True

    def __init__(self, scheme: LinearScheme, dtype: torch.dtype):
        super().__init__(scheme)
        self.npu = importlib.import_module("torch_npu")
        self.dtype = dtype

    def prepare(self, tensors: Tensors) -> Tensors:
        out, blocks = tensors["qweight"].shape[:2]  # uint8 [out, in / 32, block bytes]
        problem = weight_problem(blocks * GROUP, out, single_group(GROUP, blocks * GROUP), self.scheme.weight_bits)
        if problem:
            log_fallback(f"GGUF {self.type_name} layer [{out} x {blocks * GROUP}]", problem)
            return on_reference(tensors)
        q, scale, offset = q_scale_offset(tensors["qweight"], self.type_name)  # q [out, in], scale [out, in / 32]
        if self.scheme.weight_bits == 4:
            q = q.to(torch.int32) - 8
            offset = None if offset is None else offset + 8 * scale
        if offset is not None:  # a constant block: (w + o) * 0 cannot give it, (w + o) * tiny can
            scale = torch.where((scale == 0) & (offset != 0), offset.abs() * 2.0**-16, scale)
        if offset is not None and not bool(offset.any()):
            offset = None  # Q4_0: d (q - 8) exactly
        weight = q.t().contiguous()  # [in, out]
        if self.scheme.weight_bits == 4:
            weight = self.npu.npu_convert_weight_to_int4pack(weight.to(torch.int32))  # [in, out / 8]
        prepared = {"weight": weight, "scale": scale.t().to(self.dtype).contiguous()}  # [in / 32, out]
        if offset is not None:
            ratio = torch.where(scale == 0, torch.zeros_like(offset), offset / scale)
            prepared["offset"] = ratio.t().to(self.dtype).contiguous()
        return split_columns(prepared, out, ("weight", "scale", "offset"))

    def apply(self, x, prepared, bias):
        if ON_REFERENCE in prepared:
            return super().apply(x, prepared, bias)
        x2 = x.reshape(-1, x.shape[-1])
        group = GROUP if x2.shape[1] > GROUP else 0  # one block of 32 inputs: per-channel scales [1, out]
        y = by_columns(lambda p: self.npu.npu_weight_quant_batchmatmul(
            x2, p["weight"], p["scale"], antiquant_offset=p.get("offset"), antiquant_group_size=group), prepared)
        y = y.reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


def npu_gguf_kernel(scheme: LinearScheme, dtype: torch.dtype):
    """The NPU kernel for a GGUF scheme served in ``dtype``: torch_npu's in 16 bits, else the reference."""
    if dtype in (torch.bfloat16, torch.float16) and scheme.group_size == GROUP:  # not Q6_K (scales per 16)
        return NpuGgufKernel(scheme, dtype)
    return GgufReferenceKernel(scheme)
