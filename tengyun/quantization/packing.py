"""Round-to-nearest quantisation and compressed-tensors' int32 packing, in PyTorch.

Packing (compressed-tensors pack_to_int32, for bits dividing 32): the signed value v of element
i along the packed dim is stored as v + 2^(bits-1) in bits [bits * (i % per), ...) of word
i // per, per = 32 / bits. 4 bits, a row [-8, -1, 0, 7, 1, 2, 3, 4] -> nibbles 0, 7, 8, 15, 9,
10, 11, 12 from the low end -> one int32 0xCBA9F870.
"""

from __future__ import annotations

import torch


def pack_int32(values: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """values int8 [rows, cols] in [-2^(bits-1), 2^(bits-1)) -> int32 with ``dim`` shrunk bits / 32 times."""
    per = 32 // bits
    v = values.to(torch.int64) + (1 << (bits - 1))
    v = v.movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)  # [..., words, per]
    shifts = torch.arange(per, dtype=torch.int64, device=v.device) * bits
    words = (v << shifts).sum(-1)  # in [0, 2^32)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """pack_int32's inverse: int32 -> int8 values with ``dim`` grown 32 / bits times. In int32: an
    arithmetic shift drags the sign bit in from the top, and the mask drops it."""
    words = packed.movedim(dim, -1)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    v = (words.unsqueeze(-1) >> shifts).bitwise_and_((1 << bits) - 1)  # [..., words, 32 / bits]
    v = v.reshape(*v.shape[:-2], -1).sub_(1 << (bits - 1))
    return v.to(torch.int8).movedim(-1, dim).contiguous()


def quantize_symmetric(weight: torch.Tensor, bits: int, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Round to nearest with a min-max observer, as compressed-tensors' symmetric int schemes:
    weight [out, in] -> (q int8 [out, in], scale [out, in / group] or [out, 1] in weight's dtype),
    scale = max|w| / ((2^bits - 1) / 2), q = clamp(round(w / scale)); w ~ q * scale."""
    out, in_ = weight.shape
    group = group_size or in_
    w = weight.reshape(out, in_ // group, group)
    absmax = w.abs().amax(dim=-1, keepdim=True)
    scale = (absmax / ((2**bits - 1) / 2)).clamp(min=torch.finfo(weight.dtype).eps)
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.clamp(torch.round(w / scale), low, high).to(torch.int8)
    return q.reshape(out, in_), scale.squeeze(-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q int8 [out, in], scale and zero [out, in / group] -> (q - zero) * scale [out, in] in ``dtype``."""
    out, in_ = q.shape
    groups = scale.shape[1]
    w = q.to(torch.float32).reshape(out, groups, in_ // groups)
    if zero is not None:
        w = w - zero.to(torch.float32).unsqueeze(-1)
    return (w * scale.to(torch.float32).unsqueeze(-1)).reshape(out, in_).to(dtype)
