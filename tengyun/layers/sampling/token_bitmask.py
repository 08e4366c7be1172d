"""Structured output's mask: the tokens a grammar does not allow -> -inf, from xgrammar's bitmask."""

from __future__ import annotations

import torch


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Out of place: -inf on the tokens of `rows` whose bit is 0; other rows untouched.

    bitmask word 0b101 for V = 3 -> tokens 0 and 2 allowed, token 1 -> -inf.
    """
    V = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :V]  # [N, V]
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))
