"""CPU kernels for quantised linear layers, arithmetic as tengyun/layers/quant_kernels.py's
references (which they fall back to for a layer they cannot run).

- W8A8: activations quantised per token, then torch._int_mm (oneDNN's int8 GEMM, VNNI where the
  cores have it) on the int8 weight's transposed view, int32 sums scaled back in float32. Where the
  compiled kernels load, the quantisation and the rescale are one pass each
  (tengyun/csrc/layer_ops.cpp, bit-equal to the PyTorch ops; they are ~8 and ~4 ops that dominate a
  batch-1 step's small matmuls), and on AVX-512 VNNI cores up to ``MAX_GEMV_ROWS`` (16) rows
  run all three in one call (tengyun/csrc/int8_gemv.cpp: int32 sums bit-equal to torch._int_mm's,
  the same rescale) on the same int8 [out, in] weight: one copy serves both paths.
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


# At most this many rows run the one-call VNNI kernel (it takes up to 64); more run torch._int_mm,
# which it beats up to 16 rows at SmolLM2's shapes and not from 24-32 (benchmarks/quant_linear_kernels.py
# --gemv, benchmarks/README.md).
MAX_GEMV_ROWS = 16
GEMV_OP_MAX_ROWS = 64  # what the op takes (int8_gemv.cpp kMaxOpRows)
GEMV_MAX_INPUTS = 1 << 17  # int8_gemv's exactness bound: |x_q . w| <= 2^14 K < 2^31


def w8a8_gemv_fits() -> bool:
    """Whether the compiled kernels are loaded and this CPU runs the W8A8 small-batch kernel
    (AVX-512 F/BW/VL/DQ + VNNI)."""
    from tengyun.layers.attention import cpu_kernels

    return cpu_kernels.load_error() is None and bool(torch.ops.tengyun.w8a8_gemv_supported())


def _gemv_op(compiled: bool, max_gemv_rows: int | None):
    """torch.ops.tengyun.w8a8_gemv's overload (resolved once: ~0.6 us a call) where it runs, else None."""
    if not compiled or max_gemv_rows == 0 or not w8a8_gemv_fits():
        return None
    return torch.ops.tengyun.w8a8_gemv.default


class CpuW8A8Kernel(QuantLinearKernel):
    def __init__(self, scheme, compiled: bool = False, max_gemv_rows: int | None = None):
        """compiled: the kernel library is loaded (cpu_kernels.load_error() is None); its one-pass
        quantize_per_token_int8 and rescale_int32 replace the PyTorch ops, and up to max_gemv_rows
        rows (default MAX_GEMV_ROWS; 0: never; at most GEMV_OP_MAX_ROWS) run w8a8_gemv where the
        CPU has VNNI."""
        super().__init__(scheme)
        ops = torch.ops.tengyun if compiled else None
        self.quantize = ops.quantize_per_token_int8.default if ops else None  # overloads resolved once
        self.rescale = ops.rescale_int32.default if ops else None
        self.gemv = _gemv_op(compiled, max_gemv_rows)
        self.max_gemv_rows = min(GEMV_OP_MAX_ROWS, MAX_GEMV_ROWS if max_gemv_rows is None else max_gemv_rows)

    def apply(self, x, prepared, bias):
        x2 = x.reshape(-1, x.shape[-1])
        weight = prepared["weight"]
        scale = prepared["weight_scale"]
        if self.gemv is not None and x2.shape[0] <= self.max_gemv_rows and _gemv_takes(x2, weight, scale, bias):
            y = self.gemv(x2, weight, scale.reshape(-1), bias, None, None, None)
            return y.reshape(*x.shape[:-1], -1)
        if self.quantize is None:
            x_q, s_x = quantize_per_token(x2)
        else:
            x_q, s_x = self.quantize(x2)
        acc = torch._int_mm(x_q, weight.t())  # [M, out] int32
        if self.rescale is None:
            y = (acc.float() * s_x * prepared["weight_scale"].float().t()).to(x.dtype)
        else:
            y = self.rescale(acc, s_x, prepared["weight_scale"], x.dtype)
        y = y.reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


_GEMV_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gemv_takes(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """w8a8_gemv's argument contract: x float32/bfloat16 with unit last stride, the weight and its
    scales contiguous, fewer than 2^17 inputs (its int32 sums' bound), a bias in x's dtype.
    Anything else (float16 activations, a strided slice) takes torch._int_mm."""
    return (x.dtype in (torch.float32, torch.bfloat16) and x.stride(-1) == 1 and weight.is_contiguous()
            and weight.shape[-1] < GEMV_MAX_INPUTS
            and scale.dtype in _GEMV_SCALE_DTYPES and scale.is_contiguous()
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous())))


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


class CpuInt8WeightOnlyKernel(ReferenceWNA16Kernel):
    """8-bit weight-only (GPTQ 8-bit, compressed-tensors W8A16) in the compiled kernel's 8-bit
    layout (cpu_quant_layout.py), act order as CpuInt4PackKernel. n = q (the stored value - 128,
    int8), s the scale; a zero point becomes the offset o = -zero * s in float32 (scales widened to
    float32): fma(n, s, o) is then (q - zero) * s exactly, the reference's value, where -zero * s
    is exact in float32 (always for 16-bit scales); elsewhere the layer keeps the reference."""

    frees_original = True

    def prepare(self, tensors: Tensors) -> Tensors:
        ordered = in_group_order(unpacked_weight(tensors, self.scheme), self.scheme.group_size)
        if ordered is None:
            return tensors
        (q, scale, zero, _), perm = ordered
        if zero is None:
            prepared = cpu_quant_layout.pack(q, 8, scale)
        else:
            offsets = -zero.float() * scale.float()
            if not torch.equal(offsets.double(), -zero.double() * scale.double()):
                return tensors
            prepared = cpu_quant_layout.pack(q, 8, scale.float(), offsets=offsets)
        return prepared if perm is None else {**prepared, "perm": perm}

    def apply(self, x, prepared, bias):
        if "qpacked" not in prepared:
            return super().apply(x, prepared, bias)
        x2 = x.reshape(-1, x.shape[-1])
        x2 = gather_inputs(x2, prepared["perm"]) if "perm" in prepared else x2.contiguous()
        return cpu_quant_layout.linear(x2, prepared, 8, 0, bias).reshape(*x.shape[:-1], -1)


class CpuW8A8StaticKernel(ReferenceW8A8StaticKernel):
    """msModelSlim static W8A8: the reference's prepare, the int32 sums through torch._int_mm, or
    up to max_gemv_rows rows through w8a8_gemv (its static quantisation, quant_bias added to the
    sums) where it runs."""

    def __init__(self, scheme, compiled: bool = False, max_gemv_rows: int | None = None):
        super().__init__(scheme)
        self.gemv = _gemv_op(compiled, max_gemv_rows)
        self.max_gemv_rows = min(GEMV_OP_MAX_ROWS, MAX_GEMV_ROWS if max_gemv_rows is None else max_gemv_rows)

    def apply(self, x, prepared, bias):
        x2 = x.reshape(-1, x.shape[-1])
        weight = prepared["weight"]
        takes = (_gemv_takes(x2, weight, prepared["deq_scale"], None) and prepared["quant_bias"].dtype == torch.int32
                 and prepared["quant_bias"].is_contiguous())
        if self.gemv is not None and x2.shape[0] <= self.max_gemv_rows and takes:
            y = self.gemv(x2, weight, prepared["deq_scale"], None, prepared["quant_bias"],
                          prepared["input_scale_reciprocal"], prepared["input_offset"])
            return y.reshape(*x.shape[:-1], -1)
        x_q = quantize_per_tensor(x2, prepared["input_scale_reciprocal"], prepared["input_offset"])
        acc = torch._int_mm(x_q, weight.t()) + prepared["quant_bias"]  # [M, out] int32
        return (acc.float() * prepared["deq_scale"]).to(x.dtype).reshape(*x.shape[:-1], -1)
