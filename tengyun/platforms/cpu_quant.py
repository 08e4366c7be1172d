"""CPU kernels for quantised linear layers, arithmetic as tengyun/layers/quant_kernels.py's
references (which they fall back to for a layer they cannot run).

- W8A8: activations quantised per token, then torch._int_mm (oneDNN's int8 GEMM, VNNI where the
  cores have it) on the int8 weight's transposed view, int32 sums scaled back in float32. Where the
  compiled kernels load, the quantisation and the rescale are one pass each
  (tengyun/csrc/layer_ops.cpp, bit-equal to the PyTorch ops; they are ~8 and ~4 ops that dominate a
  batch-1 step's small matmuls).
  msModelSlim's static W8A8 alike, activations quantised with its one input scale and offset,
  quant_bias added to the int32 sums.
- 4-bit weight-only in bfloat16: where the compiled kernels load and the cores have AVX-512 BF16,
  the weight repacked once into the compiled kernel's layout (cpu_quant_layout.py: nibbles in
  blocks of 32 outputs, the checkpoint's scales and zero points; w = (n - zero) * scale exactly
  as the reference's float32 values), run by quant_gemv.cpp for a few rows and dequantized once
  per call for many. Elsewhere torch's int4 CPU matmul (_weight_int4pack_mm_for_cpu) on the
  weight repacked once (_convert_weight_to_int4pack_for_cpu: unsigned nibbles q + 8, outputs a
  multiple of 16) with scales_and_zeros [in / group, out, 2]: w = (q + 8 - 8) * scale + zero,
  zero = -zero_point * scale. One copy either way.
"""

from __future__ import annotations

import torch

from tengyun.layers.quant_kernels import (
    QuantLinearKernel, ReferenceW8A8StaticKernel, ReferenceWNA16Kernel, Tensors, gather_inputs, in_group_order,
    quantize_per_tensor, quantize_per_token, unpacked_weight,
)
from tengyun.platforms import cpu_quant_layout


class CpuW8A8Kernel(QuantLinearKernel):
    def __init__(self, scheme, compiled: bool = False):
        """compiled: the kernel library is loaded (cpu_kernels.load_error() is None); its one-pass
        quantize_per_token_int8 and rescale_int32 replace the PyTorch ops."""
        super().__init__(scheme)
        ops = torch.ops.tengyun if compiled else None
        self.quantize = ops.quantize_per_token_int8.default if ops else None  # overloads resolved once
        self.rescale = ops.rescale_int32.default if ops else None

    def apply(self, x, prepared, bias):
        x2 = x.reshape(-1, x.shape[-1])
        if self.quantize is None:
            x_q, s_x = quantize_per_token(x2)
        else:
            x_q, s_x = self.quantize(x2)
        acc = torch._int_mm(x_q, prepared["weight"].t())  # [M, out] int32
        if self.rescale is None:
            y = (acc.float() * s_x * prepared["weight_scale"].float().t()).to(x.dtype)
        else:
            y = self.rescale(acc, s_x, prepared["weight_scale"], x.dtype)
        y = y.reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


class CpuInt4PackKernel(ReferenceWNA16Kernel):
    """Any 4-bit packing (compressed-tensors, AWQ, GPTQ) read into Unpacked, then repacked: into
    the compiled kernel's layout when ``compiled`` (cpu_quant_layout.quant_gemv_fits()), else into
    torch's int4 layout. GPTQ act order: inputs sorted by group once here (a row-parallel slice
    padded to every group), activations gathered by ``perm`` per call: measured ~100x faster than
    dequantizing through g_idx per call (benchmarks/act_order_kernels.py, docs/quantization.md)."""

    frees_original = True

    def __init__(self, scheme, compiled: bool = False):
        super().__init__(scheme)
        self.compiled = compiled

    def prepare(self, tensors: Tensors) -> Tensors:
        w = unpacked_weight(tensors, self.scheme)
        ordered = in_group_order(w, self.scheme.group_size)
        if ordered is None:
            return tensors
        (q, scale, zero, _), perm = ordered
        prepared = self._compiled_layout(q, scale, zero) if self.compiled else None
        if prepared is None:
            if scale.shape[0] % 16:  # torch packs outputs in blocks of 16: the reference
                return tensors
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32) + 8, 1)
            zero_term = torch.zeros_like(scale) if zero is None else (-zero.float() * scale.float()).to(scale.dtype)
            scales_and_zeros = torch.stack([scale.t(), zero_term.t()], dim=-1).contiguous()  # [groups, out, 2]
            prepared = {"int4pack": packed, "scales_and_zeros": scales_and_zeros}
        return prepared if perm is None else {**prepared, "perm": perm}

    def _compiled_layout(self, q, scale, zero) -> Tensors | None:
        """q int8 [out, in] (stored - 8), zero int8 [out, groups] or None -> the compiled layout
        with n = q + 8 and zero points zero + 8 (symmetric: the constant 8); None where the
        kernel does not take the layer (odd groups, float32 scales whose zero term would round)."""
        in_, groups = q.shape[1], scale.shape[1]
        if in_ % groups or (in_ // groups) % 2:
            return None
        points = None if zero is None else (zero.to(torch.int16) + 8).to(torch.uint8)
        return cpu_quant_layout.pack((q.to(torch.int16) + 8).to(torch.uint8), 4, scale, points)

    def apply(self, x, prepared, bias):
        if "int4pack" not in prepared and "qpacked" not in prepared:
            return super().apply(x, prepared, bias)
        x2 = x.reshape(-1, x.shape[-1])
        x2 = gather_inputs(x2, prepared["perm"]) if "perm" in prepared else x2.contiguous()
        if "qpacked" in prepared:
            y = cpu_quant_layout.linear(x2, prepared, 4, 8, bias)  # zero point 8 unless qzeros holds them
            return y.reshape(*x.shape[:-1], -1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, prepared["int4pack"], self.scheme.group_size,
                                                        prepared["scales_and_zeros"])
        y = y.reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


class CpuW8A8StaticKernel(ReferenceW8A8StaticKernel):
    """msModelSlim static W8A8: the reference's prepare, the int32 sums through torch._int_mm."""

    def apply(self, x, prepared, bias):
        x2 = x.reshape(-1, x.shape[-1])
        x_q = quantize_per_tensor(x2, prepared["input_scale_reciprocal"], prepared["input_offset"])
        acc = torch._int_mm(x_q, prepared["weight"].t()) + prepared["quant_bias"]  # [M, out] int32
        return (acc.float() * prepared["deq_scale"]).to(x.dtype).reshape(*x.shape[:-1], -1)
