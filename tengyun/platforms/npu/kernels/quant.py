"""Quantised linear layers through torch_npu, as vLLM-Ascend runs them.

NOT YET RUN ON HARDWARE: written against the documented torch_npu APIs and tested on CPU
against a stand-in that enforces their documented contracts (tests/platforms/fake_torch_npu.py).

- W8A8: ``npu_dynamic_quant(x) -> (x_q int8 [M, K], s_x float32 [M])`` per token, then
  ``npu_quant_matmul(x_q, w [K, N] int8, scale float32 [N], pertoken_scale=s_x, output_dtype=x.dtype)``
  = (x_q @ w) * s_x * scale. With pertoken_scale and a float16 output the op takes only a
  float32 scale (its dtype table), so the weight scale is held in float32 whatever the model dtype.
- W4A16 / W8A16: ``npu_weight_quant_batchmatmul(x, w, antiquant_scale [G, N] (or [N] per
  channel), antiquant_offset (same shape, asymmetric only), antiquant_group_size=group)`` =
  x @ ((w + offset) * scale), with w int8 [K, N], or for 4 bits
  ``npu_convert_weight_to_int4pack(w int32 [K, N]) -> int32 [K, N / 8]``; offset = -zero point.
  One group of all K inputs is per-channel scaling (group 0).
- msModelSlim static W8A8, as vLLM-Ascend: ``npu_quantize(x, 1 / input_scale [K], input_offset
  [K], torch.qint8, -1, div_mode=False)`` = round(x * (1 / input_scale) + input_offset), then
  ``npu_quant_matmul(x_q, w [K, N], deq_scale [N], bias=quant_bias int32 [N], output_dtype)`` =
  (x_q @ w + quant_bias) * deq_scale. deq_scale is float32 for bfloat16 outputs; for float16 ones
  the int64 that ``npu_trans_quant_param(deq_scale float32)`` builds (its documented encoding:
  the float's top 19 bits, bit 46 set), never the float's raw bits re-encoded by hand.

Shapes past the ops' limits (matmul_limits.py): more than 65535 outputs are split by columns; a
K above 65535, a group size the op refuses, or an int4 N off 8 runs the reference kernel.
"""

from __future__ import annotations

import importlib

import torch

from tengyun.layers.quant_kernels import (
    QuantLinearKernel, Tensors, deq_scale_float32, gather_inputs, in_group_order, reference_kernel,
    refuse_tensor_parallel_static_w8a8, unpacked_weight,
)
from tengyun.platforms.npu.kernels.matmul_limits import (
    ON_REFERENCE, by_columns, log_fallback, on_reference, single_group, split_columns, weight_problem,
)


def _group_of(prepared: Tensors) -> int:
    """antiquant_group_size from the shapes: weight [K, ...], antiquant_scale [K / group, N] or [N] (0)."""
    scale = prepared["antiquant_scale"]
    return prepared["weight"].shape[0] // scale.shape[0] if scale.dim() == 2 else 0


class NpuQuantKernel(QuantLinearKernel):
    """torch_npu's op for a scheme, with the plain-PyTorch reference kept for the layers whose
    shapes the op does not take (matmul_limits.py: each such layer logs why)."""

    frees_original = True

    def __init__(self, scheme):
        super().__init__(scheme)
        self.npu = importlib.import_module("torch_npu")
        self.reference = reference_kernel(scheme)


class NpuW8A8Kernel(NpuQuantKernel):
    def prepare(self, tensors: Tensors) -> Tensors:
        n, k = tensors["weight"].shape  # [N, K] int8
        problem = weight_problem(k, n)
        if problem:
            log_fallback(f"W8A8 layer [{n} x {k}]", problem)
            return on_reference(self.reference.prepare(tensors))
        prepared = {"weight": tensors["weight"].t().contiguous(),  # [K, N]
                    "weight_scale": tensors["weight_scale"].flatten().float()}  # [N] float32
        return split_columns(prepared, n, ("weight", "weight_scale"))

    def stack_experts(self, prepared):
        """+ weight_scale_bf16 [E, N]: npu_grouped_matmul's per-token form takes a bfloat16 scale for
        bfloat16 outputs (float32 for float16), its data-type table."""
        stacked = super().stack_experts(prepared)
        if stacked is not None and "weight_scale" in stacked:
            stacked["weight_scale_bf16"] = stacked["weight_scale"].to(torch.bfloat16)
        return stacked

    def groups_experts(self, stacked, dtype):
        return grouped_ready(stacked) and dtype in (torch.float16, torch.bfloat16)

    def apply_experts(self, x, ends, stacked):
        """x_q, s_x per token (npu_dynamic_quant), then y = (x_q @ w[e]) * scale[e] * s_x per expert."""
        x_q, s_x = self.npu.npu_dynamic_quant(x)
        scale = stacked["weight_scale_bf16" if x.dtype == torch.bfloat16 else "weight_scale"]
        return self.npu.npu_grouped_matmul([x_q], [stacked["weight"]], scale=[scale], per_token_scale=[s_x],
                                           group_list=ends, split_item=2, group_type=0, group_list_type=0,
                                           output_dtype=x.dtype)[0]

    def apply(self, x, prepared, bias):
        if ON_REFERENCE in prepared:
            return self.reference.apply(x, prepared, bias)
        x2 = x.reshape(-1, x.shape[-1])
        x_q, s_x = self.npu.npu_dynamic_quant(x2)
        y = by_columns(lambda p: self.npu.npu_quant_matmul(x_q, p["weight"], p["weight_scale"], pertoken_scale=s_x,
                                                           output_dtype=x.dtype), prepared)
        y = y.reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


class NpuWNA16Kernel(NpuQuantKernel):
    """Any packing (compressed-tensors, AWQ, GPTQ) read into Unpacked; a zero point becomes
    antiquant_offset = -zero; GPTQ act order sorts the inputs by group once (a row-parallel slice
    padded to every group), the activations per call."""

    def prepare(self, tensors: Tensors) -> Tensors:
        ordered = in_group_order(unpacked_weight(tensors, self.scheme), self.scheme.group_size)
        if ordered is None:
            return on_reference(tensors)
        (q, scale, zero, _), perm = ordered
        n, k = q.shape
        group = single_group(self.scheme.group_size, k)
        problem = weight_problem(k, n, group, self.scheme.weight_bits)
        if problem:
            log_fallback(f"{self.scheme.description} layer [{n} x {k}]", problem)
            return on_reference(tensors)
        weight = q.t().contiguous()  # [in, out] int8
        if self.scheme.weight_bits == 4:
            weight = self.npu.npu_convert_weight_to_int4pack(weight.to(torch.int32))  # [in, out / 8]
        # [groups, out], or [out] per channel; the offset in the scale's dtype
        as_npu = (lambda t: t.t().contiguous()) if group else (lambda t: t.flatten())
        prepared = {"weight": weight, "antiquant_scale": as_npu(scale)}
        if zero is not None:
            prepared["antiquant_offset"] = as_npu((-zero.float()).to(scale.dtype))
        if perm is not None:
            prepared["perm"] = perm
        return split_columns(prepared, n, ("weight", "antiquant_scale", "antiquant_offset"))

    def groups_experts(self, stacked, dtype):
        """8-bit per channel, inputs in order: npu_grouped_matmul's weight-only form takes an int8
        weight per channel only (an int4 weight, per group too, but no documented 3-D int4 pack)."""
        return grouped_ready(stacked) and "perm" not in stacked and stacked["weight"].dtype == torch.int8 \
            and stacked["antiquant_scale"].dim() == 2 and stacked["antiquant_scale"].dtype == dtype

    def apply_experts(self, x, ends, stacked):
        """y = x @ ((w[e] + offset[e]) * scale[e]) per expert, in x's dtype."""
        offset = stacked.get("antiquant_offset")
        return self.npu.npu_grouped_matmul([x], [stacked["weight"]], antiquant_scale=[stacked["antiquant_scale"]],
                                           antiquant_offset=None if offset is None else [offset], group_list=ends,
                                           split_item=2, group_type=0, group_list_type=0)[0]

    def apply(self, x, prepared, bias):
        if ON_REFERENCE in prepared:
            return self.reference.apply(x, prepared, bias)
        x2 = x.reshape(-1, x.shape[-1])
        if "perm" in prepared:
            x2 = gather_inputs(x2, prepared["perm"])
        y = by_columns(lambda p: self.npu.npu_weight_quant_batchmatmul(
            x2, p["weight"], p["antiquant_scale"], antiquant_offset=p.get("antiquant_offset"),
            antiquant_group_size=_group_of(p)), prepared)
        y = y.reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


class NpuW8A8StaticKernel(NpuQuantKernel):
    def prepare(self, tensors: Tensors) -> Tensors:
        refuse_tensor_parallel_static_w8a8()
        weight = tensors["weight"]  # [N, K] int8
        n, k = weight.shape
        problem = weight_problem(k, n)
        if problem:
            log_fallback(f"static W8A8 layer [{n} x {k}]", problem)
            return on_reference(self.reference.prepare(tensors))
        deq = deq_scale_float32(tensors["deq_scale"])  # [N] float32, from either stored form
        prepared = {"weight": weight.t().contiguous(), "quant_bias": tensors["quant_bias"], "deq_scale": deq,
                    "deq_scale_int64": self.npu.npu_trans_quant_param(deq),  # float16 outputs' form
                    "scale_reciprocal": (1.0 / tensors["input_scale"]).repeat(k),  # [K] in the activations' dtype
                    "offset": tensors["input_offset"].repeat(k)}
        return split_columns(prepared, n, ("weight", "quant_bias", "deq_scale", "deq_scale_int64"))

    def apply(self, x, prepared, bias):
        if ON_REFERENCE in prepared:
            return self.reference.apply(x, prepared, bias)
        x2 = x.reshape(-1, x.shape[-1])
        offset = prepared["offset"].to(x.dtype)
        x_q = self.npu.npu_quantize(x2, prepared["scale_reciprocal"].to(x.dtype), offset, torch.qint8, -1, False)
        scale = "deq_scale_int64" if x.dtype == torch.float16 else "deq_scale"
        y = by_columns(lambda p: self.npu.npu_quant_matmul(x_q, p["weight"], p[scale], bias=p["quant_bias"],
                                                           output_dtype=x.dtype), prepared)
        return y.reshape(*x.shape[:-1], -1)


def grouped_ready(stacked: Tensors) -> bool:
    """Experts stacked whole on torch_npu's op (none on the reference, none split by columns)."""
    return "weight" in stacked and ON_REFERENCE not in stacked and "parts" not in stacked


def npu_quant_kernel(scheme) -> QuantLinearKernel:
    if scheme.kernel == "w8a8_int8":
        return NpuW8A8Kernel(scheme)
    if scheme.kernel == "w8a8_static_int8":
        return NpuW8A8StaticKernel(scheme)
    if scheme.kernel == "wna16_int":
        return NpuWNA16Kernel(scheme)
    return reference_kernel(scheme)
