"""Top-k routing and the expert order the grouped matmuls read, all on the device.

Worked example, 3 tokens, top 2, 4 experts, this rank holds experts 2 and 3 (first 2, 2 local):
    ids [[2, 0], [3, 2], [1, 0]] -> flat [2, 0, 3, 2, 1, 0]
    local key (id - first, else 2 = "not here") [0, 2, 1, 0, 2, 2]
    order (stable sort by key) [0, 3, 2, 1, 4, 5]: rows of expert 2, of expert 3, then the rest
    counts [2, 1] (per local expert), token of each sorted row order // k = [0, 1, 1, 0, 2, 2]
No count ever leaves the device: the grouped matmuls take them as a tensor, and the rows past the
local experts' (here the last 3) are masked, not sliced off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k] int64).

    Softmax in float32 over all experts, then the top k; renormalize makes the k sum to 1.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


@dataclass(frozen=True)
class ExpertOrder:
    """The T * k (token, expert) assignments sorted by local expert; every field on the device."""

    order: torch.Tensor  # [T * k] int64: flat assignment index of each sorted row
    tokens: torch.Tensor  # [T * k] int64: the token of each sorted row (order // k)
    counts: torch.Tensor  # [E_local] int64: rows of each local expert, in expert order
    local: torch.Tensor  # [T * k] bool: sorted row belongs to a local expert (the first counts.sum())


def sort_by_expert(ids: torch.Tensor, first: int, num_local: int) -> ExpertOrder:
    """ids [T, k] (global expert ids) -> ExpertOrder for experts [first, first + num_local)."""
    key = ids.flatten() - first  # [T * k]
    outside = (key < 0) | (key >= num_local)
    key = torch.where(outside, num_local, key)  # one extra group after the local ones
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_local + 1)[:num_local]
    return ExpertOrder(order, order // ids.shape[1], counts, ~outside[order])
