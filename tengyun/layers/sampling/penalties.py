"""What a request adds to its logits before the filters: logit_bias, and the repetition /
presence / frequency penalties over the tokens it has seen. Both out of place, on [B, V]."""

from __future__ import annotations

import torch

from tengyun.layers.sampling.metadata import SamplingMetadata


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                     values: torch.Tensor) -> torch.Tensor:
    """Out of place: logits[rows[i], token_ids[i]] += values[i]; other entries untouched.

    [[1, 2, 3], [1, 2, 3]], rows [0, 0], ids [0, 2], values [5, -1] -> [[6, 2, 2], [1, 2, 3]]
    """
    return logits.index_put((rows, token_ids), values, accumulate=True)


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Out of place. Repetition over prompt + output ids; presence / frequency over output ids.

    Row with output [5, 5], presence 0.5, frequency 0.25: logits[:, 5] -= 0.5 + 2 * 0.25.
    """
    B, V = logits.shape
    out_ids = md.output_token_ids  # [B, Lo], pad = V
    counts = torch.zeros(B, V + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
    counts = counts[:, :V]  # [B, V]
    in_prompt = torch.zeros(B, V + 1, dtype=torch.bool, device=logits.device)
    in_prompt.scatter_(1, md.prompt_token_ids, True)
    seen = in_prompt[:, :V] | (counts > 0)  # [B, V]

    rep = torch.where(seen, md.repetition_penalty.unsqueeze(1), 1.0)  # [B, V]
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - md.frequency_penalty.unsqueeze(1) * counts
    return logits - md.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
