"""GGUF blocks (tengyun/quantization/gguf.py) in PyTorch: dequantization and the reference kernel.

``dequantize_blocks`` turns qweight uint8 [rows, blocks, block bytes] into weights [rows, blocks *
block]; tests/quantization/test_gguf.py checks it against the gguf package's dequantize. Every
type is first split into (q, scale, offset) per 32 weights (``q_scale_offset``), w = q * scale +
offset, which is also what torch's int4 CPU matmul takes (tengyun/platforms/cpu/kernels/gguf.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tengyun.layers.quant_kernels import QuantLinearKernel
from tengyun.quantization.gguf import ggml_type_of

ROWS_PER_TILE = 1024  # the reference dequantizes this many output rows at a time: ~2.4 MB of fp32 at in = 576


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] (little-endian fp16) -> float32 [..., 1]."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 16] -> [..., 32]: the 16 low halves (elements 0..15), then the 16 high ones."""
    return torch.cat([raw & 0x0F, raw >> 4], dim=-1)


def _k_scales_mins(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes -> (scales, mins) uint8 [..., 8] of 6 bits each (ggml get_scale_min_k4):
    sub-blocks 0..3 take bytes 0..3 (scales) and 4..7 (mins) low 6 bits; 4..7 take the low / high
    nibble of bytes 8..11 with the top 2 bits of bytes 0..3 / 4..7 above them."""
    low, mid, high = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    scales = torch.cat([low & 63, (high & 0x0F) | ((low >> 6) << 4)], dim=-1)
    mins = torch.cat([mid & 63, (high >> 4) | ((mid >> 6) << 4)], dim=-1)
    return scales, mins


def q_scale_offset(qweight: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """qweight uint8 [rows, blocks, bytes] -> (q [rows, in] uint8 or int8, scale and offset float32
    [rows, in / 32]) with w = q * scale + offset per 32 weights (offset None: zero)."""
    rows = qweight.shape[0]
    if type_name == "Q8_0":
        q = qweight[..., 2:].contiguous().view(torch.int8)
        return q.reshape(rows, -1), _f16(qweight[..., 0:2]).reshape(rows, -1), None
    if type_name == "Q4_0":
        d = _f16(qweight[..., 0:2]).reshape(rows, -1)
        return _nibbles(qweight[..., 2:18]).reshape(rows, -1), d, -8 * d
    if type_name == "Q4_1":
        q = _nibbles(qweight[..., 4:20]).reshape(rows, -1)
        return q, _f16(qweight[..., 0:2]).reshape(rows, -1), _f16(qweight[..., 2:4]).reshape(rows, -1)
    if type_name == "Q4_K":
        d, dmin = _f16(qweight[..., 0:2]), _f16(qweight[..., 2:4])  # [rows, blocks, 1]
        scales, mins = _k_scales_mins(qweight[..., 4:16])  # [rows, blocks, 8]
        qs = qweight[..., 16:144].reshape(rows, -1, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low), 2c+1 (high)
        q = torch.stack([qs & 0x0F, qs >> 4], dim=3)  # [rows, blocks, 4, 2, 32]
        return q.reshape(rows, -1), (d * scales).reshape(rows, -1), (-dmin * mins).reshape(rows, -1)
    raise ValueError(f"no dequantization for ggml type {type_name}")


def q6_k_values(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K uint8 [rows, blocks, 210] -> (q - 32 int8 [rows, in], scale d * sc float32 [rows, in / 16]).
    Each half of a block (128 weights) takes 64 bytes of low nibbles and 32 of high 2-bit pairs:
    element e of the half is ql[e % 64] low (e < 64) or high nibble, with bits 2 * (e // 32) of
    qh[e % 32] above it (ggml dequantize_row_q6_K)."""
    rows = qweight.shape[0]
    ql = qweight[..., 0:128].reshape(rows, -1, 2, 1, 64)  # [rows, blocks, half, 1, 64]
    qh = qweight[..., 128:192].reshape(rows, -1, 2, 1, 32)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=3).reshape(rows, -1, 2, 4, 32)  # e // 32 = 0, 1, 2, 3
    high = torch.cat([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=3)  # [rows, blocks, half, 4, 32]
    q = (low | (high << 4)).to(torch.int8) - 32
    scale = qweight[..., 192:208].contiguous().view(torch.int8).float() * _f16(qweight[..., 208:210])
    return q.reshape(rows, -1), scale.reshape(rows, -1)


def q5_0_as_q8_0(qweight: torch.Tensor) -> torch.Tensor:
    """Q5_0 uint8 [rows, blocks, 22] -> the same weights as Q8_0 [rows, blocks, 34]: d kept,
    q - 16 (q = nibble | 5th bit << 4, bit i of the little-endian uint32 qh for element i) as int8."""
    qh = qweight[..., 2:6].to(torch.int64)
    bits = qh[..., 0] | (qh[..., 1] << 8) | (qh[..., 2] << 16) | (qh[..., 3] << 24)  # [rows, blocks]
    fifth = (bits.unsqueeze(-1) >> torch.arange(32, device=qweight.device)) & 1  # [rows, blocks, 32]
    q = (_nibbles(qweight[..., 6:22]).to(torch.int64) | (fifth << 4)) - 16
    return torch.cat([qweight[..., 0:2], q.to(torch.int8).view(torch.uint8)], dim=-1)


def q4_0_as_q8_0(qweight: torch.Tensor) -> torch.Tensor:
    """Q4_0 uint8 [rows, blocks, 18] -> the same weights as Q8_0 [rows, blocks, 34] (q - 8 as int8)."""
    q = _nibbles(qweight[..., 2:18]).to(torch.int8) - 8
    return torch.cat([qweight[..., 0:2], q.view(torch.uint8)], dim=-1)


def dequantize_blocks(qweight: torch.Tensor, type_name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """qweight uint8 [rows, blocks, bytes] -> w [rows, in] in ``dtype`` (computed in float32)."""
    if type_name == "Q6_K":
        q, scale = q6_k_values(qweight)
        return (q.float().reshape(q.shape[0], -1, 16) * scale.unsqueeze(-1)).reshape(q.shape).to(dtype)
    q, scale, offset = q_scale_offset(qweight, type_name)
    rows, in_ = q.shape
    w = q.float().reshape(rows, -1, 32) * scale.unsqueeze(-1)
    if offset is not None:
        w += offset.unsqueeze(-1)
    return w.reshape(rows, in_).to(dtype)


class GgufReferenceKernel(QuantLinearKernel):
    """qweight kept as loaded; each call dequantizes ROWS_PER_TILE output rows at a time into x's
    dtype and multiplies: y [..., out] = x [..., in] @ w^T."""

    def __init__(self, scheme):
        super().__init__(scheme)
        self.type_name = ggml_type_of(scheme).name

    def row_reader(self, prepared, dtype):
        if "qweight" not in prepared:  # a subclass's layout
            return None
        qweight, type_name = prepared["qweight"], self.type_name  # uint8 [out, blocks, bytes]
        return lambda ids: dequantize_blocks(qweight[ids], type_name, dtype)

    def apply(self, x, prepared, bias):
        qweight = prepared["qweight"]
        tiles = [F.linear(x, dequantize_blocks(qweight[r:r + ROWS_PER_TILE], self.type_name, x.dtype))
                 for r in range(0, qweight.shape[0], ROWS_PER_TILE)]
        y = tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=-1)
        return y if bias is None else y + bias
