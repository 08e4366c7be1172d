"""FP8 block-quantized checkpoints (Qwen/Qwen3.5-*-FP8, Qwen3-Next-*-FP8, DeepSeek-V3 style).

config.json: quantization_config {"quant_method": "fp8", "weight_block_size": [128, 128],
"activation_scheme": "dynamic"} (ModelSpec.fp8_block). Each quantized weight W [out, in] is stored
as float8_e4m3fn with a companion ``W_scale_inv`` [ceil(out / 128), ceil(in / 128)] (bf16 or fp32):
one factor per 128 x 128 tile, W ~= W_fp8 * scale_inv. Fused 3-D expert tensors
(``experts.gate_up_proj`` [E, 2I, H]) carry a 3-D ``experts.gate_up_proj_scale_inv`` tiled over the
last two dims. Norms, embeddings, routers and the Gated DeltaNet's small tensors stay bf16.

No platform here multiplies FP8 weights yet (Platform.fp8_matmul), so the loader dequantizes each
weight once, at read time, before any renaming or splitting, into the served --dtype.
"""

from __future__ import annotations

import torch

SCALE_SUFFIX = "_scale_inv"  # 'x.weight' -> 'x.weight_scale_inv'; 'experts.down_proj' -> 'experts.down_proj_scale_inv'
FP8_DTYPES = ("F8_E4M3",)  # safetensors' dtype names of the float8 weights a block checkpoint holds


def scale_name(weight_name: str) -> str:
    """The stored name of ``weight_name``'s block scales."""
    return weight_name + SCALE_SUFFIX


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def weight_of_scale(name: str) -> str:
    """'...q_proj.weight_scale_inv' -> '...q_proj.weight'."""
    return name[: -len(SCALE_SUFFIX)]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [..., R, C] (float8) with scale_inv [..., ceil(R / br), ceil(C / bc)] -> float32 [..., R, C],
    each (br x bc) tile times its factor; edge tiles are partial. R 3, C 5, block (2, 4): rows {0, 1} x
    cols {0..3} take scale_inv[0, 0], rows {0, 1} x col 4 scale_inv[0, 1], row 2 x cols {0..3} scale_inv[1, 0]."""
    rows, cols = weight.shape[-2:]
    br, bc = block
    expected = (*weight.shape[:-2], -(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"shape {list(scale_inv.shape)}, but a weight of shape {list(weight.shape)} in "
                         f"weight_block_size {list(block)} tiles needs {list(expected)}")
    factors = scale_inv.float().repeat_interleave(br, dim=-2)[..., :rows, :]
    factors = factors.repeat_interleave(bc, dim=-1)[..., :cols]
    return weight.float() * factors
