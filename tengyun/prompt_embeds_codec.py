"""Tensors <-> PromptEmbeds: what the front ends (LLM, the OpenAI server) read from users and what
the worker hands the model. The engine between them never sees a tensor (prompt_embeds.py)."""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np
import torch

from tengyun.prompt_embeds import PromptEmbeds

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def from_tensor(tensor: object, field: str = "prompt_embeds") -> PromptEmbeds:
    """A [seq_len, hidden] (or [1, seq_len, hidden], squeezed, as vLLM) float32 / bfloat16 / float16
    tensor, dense or sparse, on any device -> PromptEmbeds; ValueError naming ``field`` otherwise."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{field} must be a torch.Tensor of shape (seq_len, hidden_size), "
                         f"not {type(tensor).__name__}.")
    if tensor.dtype not in _DTYPES:
        dtype = str(tensor.dtype).removeprefix("torch.")
        raise ValueError(f"{field} must be float32, bfloat16 or float16, not {dtype}.")
    tensor = tensor.to_dense() if tensor.layout != torch.strided else tensor
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor.squeeze(0)
    if tensor.dim() != 2:
        raise ValueError(f"{field} must be of shape (seq_len, hidden_size); got {tuple(tensor.shape)}.")
    tensor = tensor.detach().cpu().contiguous()
    dtype = _DTYPES[tensor.dtype]
    if dtype == "bfloat16":  # numpy has no bfloat16: carry the bits
        return PromptEmbeds(tensor.view(torch.int16).numpy().view(np.uint16).copy(), dtype)
    return PromptEmbeds(tensor.numpy().copy(), dtype)


def to_tensor(embeds: PromptEmbeds, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """[seq_len, hidden] on ``device`` in ``dtype`` (None: the dtype it was sent in)."""
    data = np.ascontiguousarray(embeds.data)
    if embeds.dtype == "bfloat16":
        tensor = torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(data)
    return tensor.to(device=device, dtype=dtype or tensor.dtype)


def decode_base64(text: str | bytes, field: str = "prompt_embeds") -> PromptEmbeds:
    """vLLM's wire form: base64 of a ``torch.save``d tensor, read with weights_only (no code runs)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise ValueError(f"{field} is not valid base64 ({e}): send base64 of a torch.save()d tensor.") from None
    try:
        tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any unreadable payload is the client's error
        raise ValueError(f"{field} is not a torch.save()d tensor: {type(e).__name__}: {e}") from None
    return from_tensor(tensor, field)
