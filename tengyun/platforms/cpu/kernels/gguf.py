"""GGUF blocks on CPU (tengyun/quantization/gguf.py).

Served in bfloat16 where the compiled kernels run (cpu_quant_layout.quant_gemv_fits), Q4_0, Q4_1,
Q4_K and Q8_0 repack once into the compiled kernel's layout (CpuGgufCompiledKernel): the blocks'
values n (Q8_0: its int8 q, the kernel's 8-bit path) with w = fma(n, s, o) per 32 weights, the
blocks' own dequantized values exactly: Q4_0 s = d (float16), o = -8d; Q4_1 s = d, o = m
(float16); Q4_K s = d * sc, o = -dmin * mn (float32: 17 significant bits); Q8_0 s = d, o = 0.
Bytes per 32 weights: Q4_0 18, Q4_1 20, Q8_0 34 (as the blocks), Q4_K 24 (the blocks 18).

Elsewhere, every type repacks once into torch's int4 CPU matmul
(_weight_int4pack_mm_for_cpu, group 32), which computes w = (n - 8) * scale + zero from nibbles n:
- Q4_0, Q4_1, Q4_K are w = q * scale + offset per 32 weights with q in [0, 16)
  (tengyun/layers/gguf_kernels.py q_scale_offset): one plane, n = q, zero = offset + 8 * scale
  (Q4_0: 0; Q4_1: m + 8d; Q4_K: 8 d sc - dmin mn);
- Q8_0 (w = d q, q int8) is two planes summed, q = 16 hi + lo with hi = q >> 4 in [-8, 8) and
  lo = q & 15: the high plane n = hi + 8, scale 16d, zero 0; the low plane n = lo, scale d,
  zero 8d. 1.25 bytes per weight instead of 1.06, and no float weight.
Scales and zeros are held in bfloat16, as torch's kernel takes them (GGUF's fp16 d rounds to
bf16's 8 significant bits; 16d is exact beside d). From DEQUANTIZE_FROM_TOKENS tokens on
(prefill) the planes are unpacked to one bfloat16 weight and multiplied densely, which measured
faster there. Q6_K (a scale per 16 weights, which torch's int4 matmul cannot take) is
dequantized once to bfloat16 and multiplied densely: 2 bytes per weight instead of 0.82, but the
reference's dequantization at every step tripled Qwen2.5-Coder's decode time. Float32 activations
and layers whose outputs are not a multiple of 16 run the dequantizing reference (torch's int4
matmul in float32 measured ~20x slower than in bfloat16; docs/quantization.md).

torch's CPU int4 layout (torch 2.13, found at first use by ``_unpack_rows``): for each R output rows,
K runs of R / 2 bytes; byte j of run k holds n[row j, k] low and n[row R / 2 + j, k] high. R is 64 where
torch's kernels run AVX-512 and 32 where they run AVX2 (four float vectors either way).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from tengyun.layers.gguf_kernels import GgufReferenceKernel, dequantize_blocks, q_scale_offset
from tengyun.layers.quant_kernels import Tensors
from tengyun.platforms.cpu.kernels import quant_layout as cpu_quant_layout
from tengyun.quantization.scheme import LinearScheme

logger = logging.getLogger(__name__)

GROUP = 32
# Single thread, 1536 x 576 Q4_1 layer (ms): 256 tokens int4 4.4 vs unpack + bf16 matmul ~2.4;
# 64 tokens int4 0.63 vs ~1.8; 2048 tokens int4 47 vs ~18 (docs/quantization.md).
DEQUANTIZE_FROM_TOKENS = 256
_UNPACK_ROWS = (64, 32)  # the row-block widths torch's int4 layout is tried in (module docstring)


def int4pack_fits(scheme: LinearScheme, dtype: str, out: int) -> bool:
    """Does torch's int4 CPU matmul run this GGUF layer? Torch-free: the planner asks too."""
    return scheme.group_size == GROUP and dtype == "bfloat16" and out % 16 == 0  # not Q6_K (scales per 16)


def weight_bytes(scheme: LinearScheme, out: int, in_: int, dtype: str, compiled: bool = False) -> int | None:
    """Bytes the layer holds: ``compiled`` (the compiled kernel runs here), its layout; else the
    int4 planes (each: in / 2 per row, plus a scale and a zero per 32 weights in ``dtype``; Q8_0
    has two); None where the layer keeps its blocks."""
    from tengyun.model_spec import DTYPE_BYTES
    from tengyun.quantization.gguf import ggml_type_of

    if dtype == "bfloat16" and scheme.group_size != GROUP:  # Q6_K: dequantized once
        return out * in_ * DTYPE_BYTES[dtype]
    if compiled and int4pack_fits(scheme, dtype, 16):
        from tengyun.platforms.cpu.kernels.quant_layout import layout_bytes

        name = ggml_type_of(scheme).name
        return layout_bytes(out, in_, in_ // GROUP, scheme.weight_bits, 4 if name == "Q4_K" else 2, False,
                            name in ("Q4_1", "Q4_K"))
    if not int4pack_fits(scheme, dtype, out):
        return None
    planes = 2 if scheme.weight_bits == 8 else 1
    return planes * (out * in_ // 2 + 2 * (in_ // GROUP) * out * DTYPE_BYTES[dtype])


def int4_planes(qweight: torch.Tensor, type_name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """qweight uint8 [out, blocks, bytes] -> [(nibbles int32 [out, in] in [0, 16), scales_and_zeros
    float32 [in / 32, out, 2])] whose (n - 8) * scale + zero sum to the blocks' weights."""
    q, scale, offset = q_scale_offset(qweight, type_name)
    if type_name == "Q8_0":
        q = q.to(torch.int32)
        return [((q >> 4) + 8, torch.stack([16 * scale, torch.zeros_like(scale)], dim=-1)),
                (q & 15, torch.stack([scale, 8 * scale], dim=-1))]
    zero = 8 * scale if offset is None else offset + 8 * scale
    return [(q.to(torch.int32), torch.stack([scale, zero], dim=-1))]


class CpuGgufInt4PackKernel(GgufReferenceKernel):
    frees_original = True
    streams_quantised = True

    def prepare(self, tensors: Tensors) -> Tensors:
        qweight = tensors["qweight"]  # uint8 [out, blocks, bytes]
        if qweight.shape[0] % 16:  # torch packs outputs in blocks of 16: this layer stays on the reference
            return tensors
        prepared = {}
        for i, (nibbles, scales_and_zeros) in enumerate(int4_planes(qweight, self.type_name)):
            prepared[f"int4pack{i}"] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)
            prepared[f"scales_and_zeros{i}"] = scales_and_zeros.transpose(0, 1).to(torch.bfloat16).contiguous()
        return prepared  # int4pack{i} uint8 [out, in / 2], scales_and_zeros{i} [in / 32, out, 2]

    def apply(self, x, prepared, bias):
        if "qweight" in prepared:
            return super().apply(x, prepared, bias)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        planes = [(prepared[f"int4pack{i}"], prepared[f"scales_and_zeros{i}"])
                  for i in range(2) if f"int4pack{i}" in prepared]
        rows = _unpack_rows()
        if x2.shape[0] >= DEQUANTIZE_FROM_TOKENS and rows is not None and planes[0][0].shape[0] % rows == 0:
            y = F.linear(x2, unpacked_weight(planes))
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, planes[0][0], GROUP, planes[0][1])
            for packed, scales_and_zeros in planes[1:]:
                y += torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, GROUP, scales_and_zeros)
        y = y.reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


class CpuGgufCompiledKernel(GgufReferenceKernel):
    """Q4_0, Q4_1, Q4_K and Q8_0 in the compiled kernel's layout (the module docstring)."""

    frees_original = True
    streams_quantised = True

    def prepare(self, tensors: Tensors) -> Tensors:
        q, scale, offset = q_scale_offset(tensors["qweight"], self.type_name)  # [out, in], [out, in / 32] x 2
        if self.type_name == "Q4_0":  # o = -8 d: the kernel's constant zero point 8
            return cpu_quant_layout.pack(q, 4, scale.half())
        if self.type_name == "Q8_0":
            return cpu_quant_layout.pack(q, 8, scale.half())
        kept = torch.float16 if self.type_name == "Q4_1" else torch.float32  # Q4_K: d * sc needs 17 bits
        return cpu_quant_layout.pack(q, 4, scale.to(kept), offsets=offset.to(kept))

    def _bits_zero(self) -> tuple[int, int]:
        return (8, 0) if self.type_name == "Q8_0" else (4, 8 if self.type_name == "Q4_0" else 0)

    def groups_experts(self, stacked: Tensors, dtype: torch.dtype) -> bool:
        return cpu_quant_layout.groups(stacked)

    def apply_experts(self, x, ends, stacked):
        return cpu_quant_layout.experts_linear(x, ends, stacked, *self._bits_zero())

    def apply(self, x, prepared, bias):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        return cpu_quant_layout.linear(x2, prepared, *self._bits_zero(), bias).reshape(*x.shape[:-1], -1)

    def row_reader(self, prepared, dtype):
        bits, zero = self._bits_zero()
        return lambda ids: cpu_quant_layout.rows(prepared, ids, bits, zero, dtype)


class CpuGgufDequantizedKernel(GgufReferenceKernel):
    """Q6_K in bfloat16: dequantized once at prepare, then a dense matmul."""

    frees_original = True

    def prepare(self, tensors: Tensors) -> Tensors:
        return {"weight": dequantize_blocks(tensors["qweight"], self.type_name, torch.bfloat16)}

    def groups_experts(self, stacked: Tensors, dtype: torch.dtype) -> bool:
        return hasattr(torch, "_grouped_mm")

    def apply_experts(self, x, ends, stacked):  # torch._grouped_mm: the same matmul per expert as F.linear
        w = stacked["weight"]
        return torch._grouped_mm(x.to(w.dtype), w.transpose(1, 2), offs=ends.to(torch.int32)).to(x.dtype)

    def apply(self, x, prepared, bias):
        return F.linear(x, prepared["weight"], bias)


def unpack_int4(packed: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """torch's CPU int4pack uint8 [out, in / 2] (out a multiple of ``rows``, the layout's row-block
    width, by default the one this torch packs in: _unpack_rows) -> q uint8 [out, in]."""
    rows = rows or _unpack_rows()
    if rows is None:
        raise RuntimeError("this torch packs int4 weights in a layout unpack_int4 does not read")
    out, in_ = packed.shape[0], packed.shape[1] * 2
    runs = packed.view(out // rows, in_, rows // 2)  # [row blocks, k, j]
    q = torch.cat([runs & 0x0F, runs >> 4], dim=2)  # [row blocks, k, rows]
    return q.transpose(1, 2).reshape(out, in_)


def unpacked_weight(planes: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """[(int4pack, scales_and_zeros)] -> w [out, in] in the scales' dtype: the planes' (n - 8) *
    scale + zero per 32 inputs summed in float32, rounded once."""
    total = None
    for packed, scales_and_zeros in planes:
        n = unpack_int4(packed)
        out, in_ = n.shape
        scale, zero = scales_and_zeros.permute(1, 0, 2).float().unbind(-1)  # [out, in / 32] each
        w = (n.reshape(out, -1, GROUP).float() - 8) * scale.unsqueeze(-1) + zero.unsqueeze(-1)
        total = w if total is None else total + w
    return total.reshape(out, in_).to(planes[0][1].dtype)


@functools.cache
def _unpack_rows() -> int | None:
    """The row-block width this torch packs int4 weights in, of _UNPACK_ROWS: the one unpack_int4
    reads back exactly; None when none does (then prefill keeps torch's int4 matmul)."""
    seeded = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (max(_UNPACK_ROWS) * 2, 2 * GROUP), dtype=torch.int32, generator=seeded)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    if tuple(packed.shape) != (q.shape[0], q.shape[1] // 2):
        return None
    return next((rows for rows in _UNPACK_ROWS if torch.equal(unpack_int4(packed, rows).int(), q)), None)


def gguf_kernel(scheme: LinearScheme, dtype: torch.dtype, compiled: bool = False):
    """The CPU kernel for a GGUF scheme served in ``dtype``; ``compiled``: the compiled quant
    kernel runs here (cpu_quant_layout.quant_gemv_fits)."""
    dtype_name = str(dtype).removeprefix("torch.")
    if compiled and int4pack_fits(scheme, dtype_name, 16):
        return CpuGgufCompiledKernel(scheme)
    if int4pack_fits(scheme, dtype_name, 16) and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return CpuGgufInt4PackKernel(scheme)
    if dtype_name == "bfloat16" and scheme.group_size != GROUP:
        return CpuGgufDequantizedKernel(scheme)
    hint = "; --dtype bfloat16 runs torch's int4 matmul" if scheme.group_size == GROUP else ""
    logger.info("%s in %s dequantizes its blocks at every step on CPU%s (docs/quantization.md)",
                scheme.description, dtype_name, hint)
    return GgufReferenceKernel(scheme)
