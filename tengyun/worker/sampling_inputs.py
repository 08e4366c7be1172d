"""The sampler's per-row tensors, kept across steps while the sampling rows stay the same.

``SamplingMetadata.build`` turns each row's SamplingParams into small tensors (temperature,
top-k/p, min-p, logit bias, greedy mask). Those depend only on the params, so while the same
requests sample step after step (a steady decode batch) the last step's metadata is reused.
Rows whose inputs change every step rebuild it: penalties (the output ids grow), min_tokens
not yet reached (the stop tokens stay masked until then), seeded random sampling (a new
generator seed per token), and grammar-constrained rows (a new token bitmask).

Token ids are copied only for rows that read them (penalties): the other rows pass their
output count, so a long answer no longer costs O(length) per step here.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tengyun.layers.sampling.metadata import SamplingMetadata
from tengyun.sampling_params import SamplingParams


class SamplingRow(Protocol):  # the runner's SeqState
    token_ids: list[int]  # prompt + outputs
    num_prompt_tokens: int
    params: SamplingParams


class OutputCount:
    """Stands for a row's output ids where only their number is read (len())."""

    __slots__ = ("count",)

    def __init__(self, count: int):
        self.count = count

    def __len__(self) -> int:
        return self.count


class SamplingInputs:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self._key: tuple | None = None  # (seq_id, params) per row of the kept metadata
        self._kept: SamplingMetadata | None = None
        self.builds = 0  # SamplingMetadata.build calls (tests)

    def metadata(self, seq_ids: list[int], rows: list[SamplingRow],
                 token_bitmask: tuple[list[int], torch.Tensor] | None) -> SamplingMetadata:
        """The metadata for ``rows`` (in logits row order): the kept one when the same rows
        sampled last step and nothing in it changes per step, else a new build."""
        key = tuple((seq_id, id(row.params)) for seq_id, row in zip(seq_ids, rows))
        per_step = token_bitmask is not None or any(_changes_per_step(row) for row in rows)
        if key == self._key and not per_step and self._kept is not None:
            return self._kept
        prompts = [row.token_ids[: row.num_prompt_tokens] if row.params.repetition_penalty != 1.0 else []
                   for row in rows]
        outputs = [row.token_ids[row.num_prompt_tokens:] if row.params.uses_penalties
                   else OutputCount(len(row.token_ids) - row.num_prompt_tokens) for row in rows]
        metadata = SamplingMetadata.build([row.params for row in rows], prompts, outputs, self.vocab_size,
                                          self.device, token_bitmask=token_bitmask)
        self.builds += 1
        self._key, self._kept = (None, None) if per_step else (key, metadata)
        return metadata


def _changes_per_step(row: SamplingRow) -> bool:
    params = row.params
    if params.uses_penalties:
        return True
    if params.min_tokens and len(row.token_ids) - row.num_prompt_tokens <= params.min_tokens:
        return True  # still masking stop tokens, or unmasking them this step
    return params.seed is not None and not params.is_greedy
