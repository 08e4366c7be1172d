"""Quantised linear layers through torch_npu, as vLLM-Ascend runs them.

NOT YET RUN ON HARDWARE: written against the documented torch_npu APIs and tested on CPU
against a reference of those documented semantics (tests/platforms/fake_torch_npu.py).

- W8A8: ``npu_dynamic_quant(x) -> (x_q int8 [M, K], s_x float32 [M])`` per token, then
  ``npu_quant_matmul(x_q, w [K, N] int8, scale [N], pertoken_scale=s_x, output_dtype=x.dtype)``
  = (x_q @ w) * s_x * scale.
- W4A16 / W8A16: ``npu_weight_quant_batchmatmul(x, w, antiquant_scale [G, N] (or [N] per
  channel), antiquant_offset (same shape, asymmetric only), antiquant_group_size=group)`` =
  x @ ((w + offset) * scale), with w int8 [K, N], or for 4 bits
  ``npu_convert_weight_to_int4pack(w int32 [K, N]) -> int32 [K, N / 8]``; offset = -zero point.
- msModelSlim static W8A8, as vLLM-Ascend: ``npu_quantize(x, 1 / input_scale [K], input_offset
  [K], torch.qint8, -1, div_mode=False)`` = round(x * (1 / input_scale) + input_offset), then
  ``npu_quant_matmul(x_q, w [K, N], deq_scale [N], bias=quant_bias int32 [N], output_dtype)`` =
  (x_q @ w + quant_bias) * deq_scale; deq_scale float32 for bfloat16 outputs, its bits in int64
  for float16 ones.
"""

from __future__ import annotations

import importlib

import torch

from tengyun.layers.quant_kernels import (
    QuantLinearKernel, Tensors, deq_scale_float32, gather_inputs, in_group_order, reference_kernel,
    refuse_tensor_parallel_static_w8a8, unpacked_weight,
)


class NpuW8A8Kernel(QuantLinearKernel):
    frees_original = True

    def __init__(self, scheme):
        super().__init__(scheme)
        self.npu = importlib.import_module("torch_npu")

    def prepare(self, tensors: Tensors) -> Tensors:
        return {"weight": tensors["weight"].t().contiguous(), "weight_scale": tensors["weight_scale"].flatten()}

    def apply(self, x, prepared, bias):
        x2 = x.reshape(-1, x.shape[-1])
        x_q, s_x = self.npu.npu_dynamic_quant(x2)
        y = self.npu.npu_quant_matmul(x_q, prepared["weight"], prepared["weight_scale"], pertoken_scale=s_x,
                                      output_dtype=x.dtype)
        y = y.reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


class NpuWNA16Kernel(QuantLinearKernel):
    """Any packing (compressed-tensors, AWQ, GPTQ) read into Unpacked; a zero point becomes
    antiquant_offset = -zero; GPTQ act order sorts the inputs by group once (a row-parallel slice
    padded to every group), the activations per call."""

    frees_original = True

    def __init__(self, scheme):
        super().__init__(scheme)
        self.npu = importlib.import_module("torch_npu")
        self.reference = reference_kernel(scheme)

    def prepare(self, tensors: Tensors) -> Tensors:
        ordered = in_group_order(unpacked_weight(tensors, self.scheme), self.scheme.group_size)
        if ordered is None:
            return tensors
        (q, scale, zero, _), perm = ordered
        weight = q.t().contiguous()  # [in, out] int8
        if self.scheme.weight_bits == 4:
            weight = self.npu.npu_convert_weight_to_int4pack(weight.to(torch.int32))  # [in, out / 8]
        # [groups, out], or [out] per channel; the offset in the scale's dtype
        as_npu = (lambda t: t.t().contiguous()) if self.scheme.group_size else (lambda t: t.flatten())
        prepared = {"weight": weight, "antiquant_scale": as_npu(scale)}
        if zero is not None:
            prepared["antiquant_offset"] = as_npu((-zero.float()).to(scale.dtype))
        return prepared if perm is None else {**prepared, "perm": perm}

    def apply(self, x, prepared, bias):
        if "antiquant_scale" not in prepared:
            return self.reference.apply(x, prepared, bias)
        x2 = x.reshape(-1, x.shape[-1])
        if "perm" in prepared:
            x2 = gather_inputs(x2, prepared["perm"])
        y = self.npu.npu_weight_quant_batchmatmul(x2, prepared["weight"], antiquant_scale=prepared["antiquant_scale"],
                                                  antiquant_offset=prepared.get("antiquant_offset"),
                                                  antiquant_group_size=self.scheme.group_size or 0)
        y = y.reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


class NpuW8A8StaticKernel(QuantLinearKernel):
    frees_original = True

    def __init__(self, scheme):
        super().__init__(scheme)
        self.npu = importlib.import_module("torch_npu")

    def prepare(self, tensors: Tensors) -> Tensors:
        refuse_tensor_parallel_static_w8a8()
        weight = tensors["weight"]  # [N, K] int8
        k = weight.shape[1]
        deq = deq_scale_float32(tensors["deq_scale"])  # [N]
        return {"weight": weight.t().contiguous(), "quant_bias": tensors["quant_bias"], "deq_scale": deq,
                "deq_scale_int64": deq.view(torch.int32).to(torch.int64),
                "scale_reciprocal": (1.0 / tensors["input_scale"]).repeat(k),  # [K] in the activations' dtype
                "offset": tensors["input_offset"].repeat(k)}

    def apply(self, x, prepared, bias):
        x2 = x.reshape(-1, x.shape[-1])
        x_q = self.npu.npu_quantize(x2, prepared["scale_reciprocal"], prepared["offset"], torch.qint8, -1, False)
        scale = prepared["deq_scale_int64" if x.dtype == torch.float16 else "deq_scale"]
        y = self.npu.npu_quant_matmul(x_q, prepared["weight"], scale, bias=prepared["quant_bias"],
                                      output_dtype=x.dtype)
        return y.reshape(*x.shape[:-1], -1)


def npu_quant_kernel(scheme) -> QuantLinearKernel:
    if scheme.kernel == "w8a8_int8":
        return NpuW8A8Kernel(scheme)
    if scheme.kernel == "w8a8_static_int8":
        return NpuW8A8StaticKernel(scheme)
    if scheme.kernel == "wna16_int":
        return NpuWNA16Kernel(scheme)
    return reference_kernel(scheme)
