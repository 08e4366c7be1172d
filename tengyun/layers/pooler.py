"""The pooling arithmetic: the rows of a prompt's last hidden states -> its output.

Two parts, as the rows arrive in chunks (chunked prefill) and in batches:
    PooledRows  per sequence, what its chunks so far contribute, until its last prompt token:
                LAST  the last chunk's last row                      [H]
                CLS   the first chunk's first row                    [H]
                MEAN  a running float32 sum over the rows / T        [H]
                ALL   every chunk's rows, concatenated               [T, H]
    Pooler      the head over the pooled rows: embed -> truncated to `dimensions` (Matryoshka),
                then L2-normalised; classify / reward -> the score layer [L, H], then softmax
                over the labels (sigmoid with one label) where activation is on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tengyun.pooling_config import PoolingModel
from tengyun.pooling_params import PoolingParams


class PooledRows:
    """Partial pooled state of the sequences whose prompt is being computed."""

    def __init__(self):
        self.partial: dict[int, torch.Tensor | list[torch.Tensor]] = {}

    def add(self, seq_id: int, params: PoolingParams, rows: torch.Tensor, start: int,
            num_prompt_tokens: int) -> torch.Tensor | None:
        """rows [n, H]: hidden states of prompt positions [start, start + n). Returns the pooled
        [H] (ALL: [T, H]) once the chunk ends the prompt, else None. LAST with a prefix-cache hit
        starts at start > 0: only the last row is read."""
        end = start + len(rows)
        kind = params.pooling_type
        if kind == "CLS" and start == 0:
            self.partial[seq_id] = rows[0]
        elif kind == "MEAN":
            total = rows.float().sum(dim=0)
            self.partial[seq_id] = total if start == 0 else self.partial[seq_id] + total
        elif kind == "ALL":
            self.partial[seq_id] = [rows] if start == 0 else [*self.partial[seq_id], rows]
        if end < num_prompt_tokens:
            return None
        if kind == "LAST":
            return rows[-1]
        pooled = self.partial.pop(seq_id)
        if kind == "MEAN":
            return pooled / num_prompt_tokens
        return torch.cat(pooled) if kind == "ALL" else pooled

    def discard(self, seq_id: int) -> None:
        """A sequence finished, aborted or preempted (a preempted one starts again at position 0)."""
        self.partial.pop(seq_id, None)


class Pooler:
    """The model's head over pooled rows; ``score``: the model's classify / reward layer (the
    model owns it, and its checkpoint name "score.weight"), None for embed."""

    def __init__(self, model: PoolingModel, score: nn.Module | None):
        self.pooling = model
        self.score = score

    def __call__(self, pooled: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """pooled [H] or [T, H] (model dtype, MEAN float32) -> float32 [D] / [L] (or [T, D] / [T, L])."""
        if self.score is None:
            x = pooled.float()
            if params.dimensions is not None:
                x = x[..., : params.dimensions]
            return F.normalize(x, p=2, dim=-1) if params.normalize else x
        logits = self.score(pooled.to(self.score.weight.dtype)).float()
        if not params.activation:
            return logits
        return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
