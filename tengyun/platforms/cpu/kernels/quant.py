"""CPU kernels for quantised linear layers, arithmetic as tengyun/layers/quant_kernels.py's
references (which they fall back to for a layer they cannot run).

- W8A8: on AVX-512 VNNI cores where the compiled kernels load, the int8 weight is repacked once
  (``pack_w8a8_weight``: blocks of 16 outputs x 4 inputs, the one copy kept) and every call, decode
  or prefill, quantises, multiplies and rescales in one op (tengyun/csrc/int8_gemv.cpp: int32 sums
  bit-equal to torch._int_mm's, the same float32 rescale). Elsewhere activations are quantised per
  token, then torch._int_mm (oneDNN's int8 GEMM) on the int8 weight's transposed view, int32 sums
  scaled back in float32, the quantisation and the rescale one compiled pass each where the
  kernels load (tengyun/csrc/layer_ops.cpp, bit-equal to the PyTorch ops). msModelSlim's static
  W8A8 alike, activations quantised with its one input scale and offset, quant_bias added to the
  int32 sums.
- 4-bit weight-only in bfloat16: where the compiled kernels load and the cores have AVX-512 BF16,
  the weight repacked once into the compiled kernel's layout (cpu/kernels/quant_layout.py: nibbles in
  blocks of 32 outputs, the checkpoint's scales and zero points; w = (n - zero) * scale exactly
  as the reference's float32 values), run by quant_gemv.cpp for a few rows and dequantized once
  per call for many. Elsewhere torch's int4 CPU matmul (_weight_int4pack_mm_for_cpu) on the
  weight repacked once (_convert_weight_to_int4pack_for_cpu: unsigned nibbles q + 8, outputs a
  multiple of 16) with scales_and_zeros [in / group, out, 2]: w = (q + 8 - 8) * scale + zero,
  zero = -zero_point * scale. One copy either way.
"""

from __future__ import annotations

import functools

import torch

from tengyun.layers.quant_kernels import (
    QuantLinearKernel, ReferenceW8A8StaticKernel, ReferenceWNA16Kernel, Tensors, gather_inputs, in_group_order,
    quantize_per_tensor, quantize_per_token, unpacked_weight,
)
from tengyun.platforms.cpu.kernels import quant_layout as cpu_quant_layout


PACKED_MAX_INPUTS = 1 << 17  # the packed op's exactness bound: |x_q . w| <= 2^14 K < 2^31


def w8a8_packed_fits() -> bool:
    """Whether the compiled kernels are loaded and this CPU runs the packed W8A8 kernel
    (AVX-512 F/BW/VL/DQ + VNNI)."""
    from tengyun.platforms.cpu import native

    return native.load_error() is None and bool(torch.ops.tengyun.w8a8_packed_supported())


def _packed_op(compiled: bool):
    """torch.ops.tengyun.w8a8_packed_gemm's overload (resolved once: ~0.6 us a call) where it runs, else None."""
    return torch.ops.tengyun.w8a8_packed_gemm.default if compiled and w8a8_packed_fits() else None


def pack_w8a8_weight(weight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> uint8 [ceil(N / 16), ceil(K / 4), 64]: block b, quad q holds outputs
    16b..16b+15 x inputs 4q..4q+3 (byte 4j + i: output 16b + j, input 4q + i) as w + 128; zero
    weights past N and K (int8_gemv.cpp)."""
    out, in_ = weight.shape
    padded = torch.nn.functional.pad(weight, (0, -in_ % 4, 0, -out % 16))
    unsigned = (padded.to(torch.int16) + 128).to(torch.uint8)
    blocks, quads = padded.shape[0] // 16, padded.shape[1] // 4
    return unsigned.reshape(blocks, 16, quads, 4).permute(0, 2, 1, 3).reshape(blocks, quads, 64).contiguous()


def packed_weight_bytes(out: int, in_: int) -> int:
    """What pack_w8a8_weight holds for an out x in layer."""
    return -(-out // 16) * 16 * -(-in_ // 4) * 4


_PACKED_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _packs(weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """The packed op's contract on a layer: fewer than 2^17 inputs (its int32 sums' bound), one
    scale per output in a dtype it reads."""
    return (weight.dtype == torch.int8 and weight.dim() == 2 and weight.shape[-1] < PACKED_MAX_INPUTS
            and scale.dtype in _PACKED_SCALE_DTYPES and scale.numel() == weight.shape[0])


def _run_packed(op, x: torch.Tensor, prepared: Tensors, scale: torch.Tensor, bias: torch.Tensor | None,
                quant_bias=None, reciprocal=None, offset=None) -> torch.Tensor:
    """x [..., in] through the packed op; activations other than float32/bfloat16 (float16) and a
    bias in another dtype go through float32."""
    x2 = x.reshape(-1, x.shape[-1])
    run_dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    x2 = x2.to(run_dtype) if x2.stride(-1) == 1 else x2.to(run_dtype).contiguous()
    op_bias = None if bias is None else bias.to(run_dtype).contiguous()
    y = op(x2, prepared["packed"], scale, op_bias, quant_bias, reciprocal, offset, scale.numel())
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def _run_packed_experts(x: torch.Tensor, ends: torch.Tensor, stacked: Tensors, scale: torch.Tensor,
                        quant_bias=None, reciprocal=None, offset=None) -> torch.Tensor:
    """x [R, in] sorted by expert through each expert's packed weight (csrc/moe_grouped.cpp), the
    dtypes as _run_packed; rows past ends[-1] are 0."""
    run_dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    y = _moe_packed_op()(x.to(run_dtype).contiguous(), ends, stacked["packed"], scale, quant_bias, reciprocal, offset,
                         scale.shape[1])
    return y.to(x.dtype)


@functools.cache
def _moe_packed_op():
    return torch.ops.tengyun.moe_w8a8_packed_gemm.default


class CpuW8A8Kernel(QuantLinearKernel):
    streams_quantised = True  # the int8 weight as held, packed or through torch._int_mm

    def __init__(self, scheme, compiled: bool = False, pack: bool = True):
        """compiled: the kernel library is loaded (native.load_error() is None); where the CPU
        has VNNI (and ``pack``) the weight is repacked once and every call runs w8a8_packed_gemm,
        else the compiled quantize_per_token_int8 and rescale_int32 around torch._int_mm."""
        super().__init__(scheme)
        ops = torch.ops.tengyun if compiled else None
        self.quantize = ops.quantize_per_token_int8.default if ops else None  # overloads resolved once
        self.rescale = ops.rescale_int32.default if ops else None
        self.packed = _packed_op(compiled) if pack else None
        self.frees_original = self.packed is not None  # the packed copy replaces the loaded weight

    def prepare(self, tensors: Tensors) -> Tensors:
        weight, scale = tensors["weight"], tensors["weight_scale"]
        if self.packed is None or not _packs(weight, scale):
            return tensors
        return {"packed": pack_w8a8_weight(weight), "weight_scale": scale.reshape(-1).contiguous()}

    def groups_experts(self, stacked: Tensors, dtype: torch.dtype) -> bool:
        return "packed" in stacked

    def apply_experts(self, x, ends, stacked):
        return _run_packed_experts(x, ends, stacked, stacked["weight_scale"])

    def apply(self, x, prepared, bias):
        if "packed" in prepared:
            return _run_packed(self.packed, x, prepared, prepared["weight_scale"], bias)
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
    streams_quantised = True  # where prepare repacks (``streams``)

    def __init__(self, scheme, compiled: bool = False):
        super().__init__(scheme)
        self.compiled = compiled

    def streams(self, prepared: Tensors) -> bool:
        return "qpacked" in prepared or "int4pack" in prepared

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

    def groups_experts(self, stacked: Tensors, dtype: torch.dtype) -> bool:
        return cpu_quant_layout.groups(stacked)  # the compiled layout; torch's int4 layout loops

    def apply_experts(self, x, ends, stacked):
        return cpu_quant_layout.experts_linear(x, ends, stacked, 4, 8)

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
    layout (cpu/kernels/quant_layout.py), act order as CpuInt4PackKernel. n = q (the stored value - 128,
    int8), s the scale; a zero point becomes the offset o = -zero * s in float32 (scales widened to
    float32): fma(n, s, o) is then (q - zero) * s exactly, the reference's value, where -zero * s
    is exact in float32 (always for 16-bit scales); elsewhere the layer keeps the reference."""

    frees_original = True
    streams_quantised = True  # where prepare repacks (``streams``)

    def streams(self, prepared: Tensors) -> bool:
        return "qpacked" in prepared

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

    def groups_experts(self, stacked: Tensors, dtype: torch.dtype) -> bool:
        return cpu_quant_layout.groups(stacked)

    def apply_experts(self, x, ends, stacked):
        return cpu_quant_layout.experts_linear(x, ends, stacked, 8, 0)

    def apply(self, x, prepared, bias):
        if "qpacked" not in prepared:
            return super().apply(x, prepared, bias)
        x2 = x.reshape(-1, x.shape[-1])
        x2 = gather_inputs(x2, prepared["perm"]) if "perm" in prepared else x2.contiguous()
        return cpu_quant_layout.linear(x2, prepared, 8, 0, bias).reshape(*x.shape[:-1], -1)


class CpuW8A8StaticKernel(ReferenceW8A8StaticKernel):
    """msModelSlim static W8A8: the reference's prepare, then (where the CPU has VNNI) the weight
    repacked and every call through w8a8_packed_gemm (its static quantisation, quant_bias added to
    the int32 sums), else the int32 sums through torch._int_mm."""

    def __init__(self, scheme, compiled: bool = False, pack: bool = True):
        super().__init__(scheme)
        self.packed = _packed_op(compiled) if pack else None
        self.frees_original = self.packed is not None

    def prepare(self, tensors: Tensors) -> Tensors:
        prepared = super().prepare(tensors)
        quant_bias = prepared["quant_bias"]
        if self.packed is None or not _packs(prepared["weight"], prepared["deq_scale"]) \
                or quant_bias.dtype != torch.int32:
            return prepared
        rest = {k: v for k, v in prepared.items() if k != "weight"}
        return {**rest, "packed": pack_w8a8_weight(prepared["weight"]), "quant_bias": quant_bias.contiguous(),
                "deq_scale": prepared["deq_scale"].contiguous()}

    def groups_experts(self, stacked: Tensors, dtype: torch.dtype) -> bool:
        return "packed" in stacked

    def apply_experts(self, x, ends, stacked):
        return _run_packed_experts(x, ends, stacked, stacked["deq_scale"], stacked["quant_bias"],
                                   stacked["input_scale_reciprocal"], stacked["input_offset"])

    def apply(self, x, prepared, bias):
        if "packed" in prepared:
            return _run_packed(self.packed, x, prepared, prepared["deq_scale"], None, prepared["quant_bias"],
                               prepared["input_scale_reciprocal"], prepared["input_offset"])
        x2 = x.reshape(-1, x.shape[-1])
        x_q = quantize_per_tensor(x2, prepared["input_scale_reciprocal"], prepared["input_offset"])
        acc = torch._int_mm(x_q, prepared["weight"].t()) + prepared["quant_bias"]  # [M, out] int32
        return (acc.float() * prepared["deq_scale"]).to(x.dtype).reshape(*x.shape[:-1], -1)
