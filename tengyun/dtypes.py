"""The one table of the dtypes Tengyun serves in: name, bytes per element, torch dtype.

Torch-free to import (the planner reads the byte counts on hosts without torch); ``torch_dtype``
imports torch when asked. Names are vLLM's (--dtype, --kv-cache-dtype); aliases resolve first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # name -> bytes per element
DTYPE_ALIASES = {"float": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def canonical_dtype(name: str) -> str:
    """'bf16' -> 'bfloat16', 'half' -> 'float16'; other names unchanged (validated by the caller)."""
    return DTYPE_ALIASES.get(str(name), str(name))


def torch_dtype(name: str) -> torch.dtype:
    """'bfloat16' (or an alias: 'bf16') -> torch.bfloat16; a name outside DTYPE_BYTES -> KeyError."""
    import torch

    name = canonical_dtype(name)
    if name not in DTYPE_BYTES:
        raise KeyError(f"{name!r} is not a dtype Tengyun serves in ({', '.join(DTYPE_BYTES)})")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype | str) -> str:
    """torch.bfloat16 or 'bfloat16' -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")
