"""GGUF blocks on CPU (tengyun/quantization/gguf.py).

Q4_0, Q4_1 and Q4_K served in bfloat16 repack once into torch's int4 CPU matmul
(_weight_int4pack_mm_for_cpu, group 32): every type is w = q * scale + offset per 32 weights with
q in [0, 16) (tengyun/layers/gguf_kernels.py q_scale_offset), and torch computes
w = (q - 8) * scale + zero, so zero = offset + 8 * scale (Q4_0: 0; Q4_1: m + 8d; Q4_K:
8 d sc - dmin mn). Scales and zeros are held in bfloat16, as torch's kernel takes them (GGUF's
fp16 d rounds to bf16's 8 significant bits). Q8_0, float32 activations and layers whose outputs
are not a multiple of 16 run the dequantizing reference (torch's int4 matmul in float32 measured
~20x slower than it in bfloat16; docs/quantization.md).
"""

from __future__ import annotations

import torch

from tengyun.layers.gguf_kernels import GgufReferenceKernel, q_scale_offset
from tengyun.layers.quant_kernels import Tensors
from tengyun.quantization.gguf import ggml_type_of
from tengyun.quantization.scheme import LinearScheme

GROUP = 32


def int4pack_fits(scheme: LinearScheme, dtype: str, out: int) -> bool:
    """Does torch's int4 CPU matmul run this GGUF layer? Torch-free: the planner asks too."""
    return scheme.weight_bits == 4 and dtype == "bfloat16" and out % 16 == 0


def weight_bytes(scheme: LinearScheme, out: int, in_: int, dtype: str) -> int | None:
    """Bytes the int4 repack holds (in / 2 per row, plus a scale and a zero per 32 weights in
    ``dtype``); None where the layer keeps its blocks."""
    from tengyun.model_spec import DTYPE_BYTES

    if not int4pack_fits(scheme, dtype, out):
        return None
    return out * in_ // 2 + 2 * (in_ // GROUP) * out * DTYPE_BYTES[dtype]


class CpuGgufInt4PackKernel(GgufReferenceKernel):
    frees_original = True

    def prepare(self, tensors: Tensors) -> Tensors:
        qweight = tensors["qweight"]  # uint8 [out, blocks, bytes]
        if qweight.shape[0] % 16:  # torch packs outputs in blocks of 16: this layer stays on the reference
            return tensors
        q, scale, offset = q_scale_offset(qweight, ggml_type_of(self.scheme).name)
        zero = 8 * scale if offset is None else offset + 8 * scale
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        return {"int4pack": packed, "scales_and_zeros": scales_and_zeros}  # [in / 32, out, 2]

    def apply(self, x, prepared, bias):
        if "int4pack" not in prepared:
            return super().apply(x, prepared, bias)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, prepared["int4pack"], GROUP, prepared["scales_and_zeros"])
        y = y.reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


def gguf_kernel(scheme: LinearScheme, dtype: torch.dtype):
    """The CPU kernel for a GGUF scheme served in ``dtype``."""
    dtype_name = str(dtype).removeprefix("torch.")
    if int4pack_fits(scheme, dtype_name, 16) and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return CpuGgufInt4PackKernel(scheme)
    return GgufReferenceKernel(scheme)
