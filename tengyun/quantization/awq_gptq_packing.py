"""AWQ GEMM and GPTQ tensors (tengyun/quantization/awq.py, gptq.py) -> the weight-only kernels'
common form (tengyun/layers/quant_kernels.py Unpacked): q int8 [out, in] and zero [out, groups]
as signed values (stored unsigned value - 2^(bits-1)), scale [out, groups], and for GPTQ act order
g_idx [in]. Also the load-time checks of the tensors GPTQ drops (a trivial g_idx, symmetric zeros).

    AWQ, one word of qweight (or qzeros) 0x76543210 -> nibbles 0..7 from the low end hold outputs
    0, 2, 4, 6, 1, 3, 5, 7: outputs 0..7 read 0, 4, 1, 5, 2, 6, 3, 7 (AWQ_REVERSE_ORDER's nibbles).
    GPTQ v1 zeros: stored 7 (4 bits) -> z = 8 -> signed 0; v2 stores 8.
"""

from __future__ import annotations

import torch

from tengyun.quantization.packing import unpack_int32
from tengyun.quantization.scheme import LinearScheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a word holds output AWQ_ORDER[j] of its 8
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # output c of a word sits in nibble AWQ_REVERSE_ORDER[c]


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, out / 8] in AWQ's order -> int8 [rows, out] signed, outputs in order."""
    values = unpack_int32(packed, 4, dim=1)  # [rows, out]: nibble j of word w at column 8w + j
    rows, out = values.shape
    order = torch.tensor(AWQ_REVERSE_ORDER, device=packed.device)
    return values.reshape(rows, out // 8, 8).index_select(2, order).reshape(rows, out)


def unpack_awq(tensors: dict[str, torch.Tensor]) -> tuple:
    """qweight [in, out / 8], qzeros [groups, out / 8], scales [groups, out] ->
    (q int8 [out, in], scale [out, groups], zero int8 [out, groups], None)."""
    q = _awq_columns(tensors["qweight"]).t()
    zero = _awq_columns(tensors["qzeros"]).t()
    return q, tensors["scales"].t(), zero, None


def unpack_gptq(tensors: dict[str, torch.Tensor], scheme: LinearScheme) -> tuple:
    """qweight [in / pack, out], scales [groups, out], qzeros [groups, out / pack] (absent when
    symmetric: zero 0), g_idx [in] (absent unless act order) ->
    (q int8 [out, in], scale [out, groups], zero int16 [out, groups] or None, g_idx int64 [in] or None)."""
    bits = scheme.weight_bits
    q = unpack_int32(tensors["qweight"], bits, dim=0).t()
    zero = tensors.get("qzeros")
    if zero is not None:
        zero = unpack_int32(zero, bits, dim=1).to(torch.int16)
        if scheme.packing == "gptq":  # v1: stored z - 1 (AutoGPTQ's kernels add the one back, unmasked)
            zero += 1
        zero = zero.t()
    g_idx = tensors.get("g_idx")
    return q, tensors["scales"].t(), zero, None if g_idx is None else g_idx.long()


def _mid_word(bits: int, value: int) -> int:
    """``value`` in every bits-wide field of an int32, as a signed int32: 4 bits, 7 -> 0x77777777."""
    word = sum(value << (bits * j) for j in range(32 // bits))
    return word - (1 << 32) if word >= 1 << 31 else word


def dropped_tensor_problem(name: str, loaded: torch.Tensor, scheme: LinearScheme, in_total: int) -> str | None:
    """Why a GPTQ tensor the scheme drops at load (kept=False) disagrees with config.json, or None:
    g_idx without act order must be i // group; qzeros of a symmetric checkpoint must be 2^(bits-1)
    (v1: stored minus one) everywhere."""
    if name == "g_idx":
        group = scheme.group_size or in_total
        expected = torch.arange(in_total, device=loaded.device) // group
        if not torch.equal(loaded.long(), expected):
            return ("is not input // group_size, but config.json says desc_act false: set desc_act true "
                    "(act order) in quantization_config")
        return None
    if name == "qzeros":
        bits = scheme.weight_bits
        stored = (1 << (bits - 1)) - (1 if scheme.packing == "gptq" else 0)
        if not bool((loaded == _mid_word(bits, stored)).all()):
            return (f"holds zero points other than {1 << (bits - 1)} ({scheme.packing} stores {stored}), but "
                    f"config.json says sym true: set sym false in quantization_config")
        return None
    raise ValueError(f"{name}: no load-time check for a dropped {scheme.packing} tensor")
