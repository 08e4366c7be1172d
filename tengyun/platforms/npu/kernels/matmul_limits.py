"""The shape limits of torch_npu's quantised matmuls, checked once per layer as a kernel prepares
its weight (op-plugin docs/zh/custom_APIs/torch_npu/, each op's 参数说明 and 约束说明):

- npu_quant_matmul: the last dims of x1 and x2 (K of x_q [M, K], N of w [K, N]) at most 65535.
- npu_weight_quant_batchmatmul: K and N in [1, 65535]; antiquant_group_size 0 (per channel), or
  in [32, K - 1] and a multiple of 32.
- npu_convert_weight_to_int4pack: the last dim (N of w [K, N]) a multiple of 8.

A weight of more than 65535 outputs is split into column chunks, each multiplied on its own and
the outputs concatenated, as vLLM-Ascend splits its widest W8A8 weight (a quantised LM head of
151,936 outputs: three chunks). A K above 65535, a group size the op refuses, or an int4 N off 8
keeps the layer on the reference kernel, logged once with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from tengyun.layers.quant_kernels import Tensors

logger = logging.getLogger(__name__)

MAX_DIM = 65535
_CHUNK = 65472  # 1023 * 64: the widest column chunk, whole int4 words of 8
ON_REFERENCE = "on_reference"  # a prepared dict's marker: the layer runs the reference kernel
_logged: set[str] = set()


def column_chunks(n: int) -> list[slice]:
    """n outputs -> even chunks of at most 65472, multiples of 64 but the last:
    151936 -> [0:50688, 50688:101376, 101376:151936]; 4096 -> [0:4096]."""
    count = -(-n // _CHUNK)
    width = -(-n // (count * 64)) * 64
    return [slice(start, min(start + width, n)) for start in range(0, n, width)]


def single_group(group_size: int | None, k: int) -> int | None:
    """A group of all K inputs is per-channel scaling (group 0 for the op): None; else the group."""
    return None if group_size is None or group_size >= k else group_size


def weight_problem(k: int, n: int, group_size: int | None = None, bits: int = 8) -> str | None:
    """Why torch_npu cannot multiply a [K, N] weight (group_size per single_group), or None."""
    if k > MAX_DIM:
        return f"its {k} inputs exceed the {MAX_DIM} torch_npu's quantised matmuls take"
    if group_size is not None and not (32 <= group_size <= k - 1 and group_size % 32 == 0):
        return (f"the checkpoint's group_size {group_size} (quantization_config in config.json) is outside "
                f"npu_weight_quant_batchmatmul's [32, K - 1 = {k - 1}] or not a multiple of 32; requantise "
                f"with group_size 32, 64 or 128")
    if bits == 4 and n % 8:
        return f"its {n} outputs are not a multiple of 8 (npu_convert_weight_to_int4pack packs 8 per int32)"
    return None


def on_reference(prepared: Tensors) -> Tensors:
    return {**prepared, ON_REFERENCE: torch.empty(0)}


def log_fallback(layer: str, problem: str) -> None:
    message = f"{layer} runs on the reference kernel, not torch_npu's: {problem}"
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)


def split_columns(prepared: Tensors, n: int, columns: Iterable[str]) -> Tensors:
    """prepared with the per-output tensors named in ``columns`` (last dim n, or n / 8 for an int4
    pack) -> {"parts": [their column chunks, one dict each], the other keys as they were};
    unchanged when n fits one chunk."""
    chunks = column_chunks(n)
    if len(chunks) == 1:
        return prepared
    columns = [name for name in columns if name in prepared]
    parts = []
    for cols in chunks:
        part = {}
        for name in columns:
            t = prepared[name]
            per = n // t.shape[-1]  # 8 for an int4 pack, else 1
            part[name] = t[..., cols.start // per:cols.stop // per].contiguous()
        parts.append(part)
    rest = {name: t for name, t in prepared.items() if name not in columns}
    return {**rest, "parts": parts}


def by_columns(matmul: Callable[[Tensors], torch.Tensor], prepared: Tensors) -> torch.Tensor:
    """matmul(prepared), or over split_columns' parts concatenated along the outputs."""
    parts = prepared.get("parts")
    if parts is None:
        return matmul(prepared)
    return torch.cat([matmul({**prepared, **part}) for part in parts], dim=-1)
