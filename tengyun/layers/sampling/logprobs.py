"""Logprobs returned with a step: the sampled token's, its rank, and the top-k beside it."""

from __future__ import annotations

import torch


def gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, max_k: int):
    """logprobs [B, V], sampled [B] -> ids [B, 1 + max_k], logprobs [B, 1 + max_k], ranks [B];
    column 0 is the sampled (or, for prompt logprobs, the actual next) token."""
    sampled = sampled.unsqueeze(1)  # [B, 1]
    sampled_lp = logprobs.gather(1, sampled)  # [B, 1]
    ranks = (logprobs >= sampled_lp).sum(dim=-1)  # [B], as vLLM: ties rank after
    if max_k == 0:
        return sampled, sampled_lp, ranks
    top_lp, top_ids = logprobs.topk(max_k, dim=-1)  # descending
    return torch.cat([sampled, top_ids], dim=1), torch.cat([sampled_lp, top_lp], dim=1), ranks
