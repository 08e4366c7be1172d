"""PromptEmbedsRows: the worker's copy of each sequence's prompt embeddings, and each step's
inputs_embeds for the flat batch when a scheduled chunk covers such a prompt.

A sequence with a prompt of P embedding rows holds placeholder ids at positions [0, P) and real
ids after (its outputs). The step's input is the embedding of every input id, with the rows of
positions < P replaced by the prompt's: chunk (offset 4, start 6, 5 tokens) of a P = 8 prompt
-> flat rows 4, 5 take prompt rows 6, 7; rows 6..8 (its outputs) keep their ids' embeddings.
Only the first pipeline stage embeds; later ones take the previous stage's hidden states.
"""

from __future__ import annotations

import torch
from torch import nn

from tengyun.prompt_embeds import PromptEmbeds
from tengyun.prompt_embeds_codec import to_tensor


class PromptEmbedsRows:
    def __init__(self, model: nn.Module, device: torch.device, first_stage: bool = True):
        self.model = model
        self.device = device
        self.first_stage = first_stage  # later pipeline stages keep nothing
        self.rows: dict[int, torch.Tensor] = {}  # seq_id -> [P, hidden] in the sender's dtype, on device

    def add(self, seq_id: int, embeds: PromptEmbeds | None) -> None:
        if embeds is not None and self.first_stage:
            self.rows[seq_id] = to_tensor(embeds, None, self.device)

    def discard(self, seq_id: int) -> None:
        self.rows.pop(seq_id, None)

    def inputs_embeds(self, input_ids: torch.Tensor, chunks: list[tuple[int, int, int, int]]) -> torch.Tensor | None:
        """[T, hidden] in the model's dtype for input_ids [T] and the step's chunks (seq_id, first
        row, rows, first position); None when no chunk reaches into an embeddings prompt."""
        if not self.rows:  # no embeddings prompt on this worker: nothing to walk each step
            return None
        covered = [(offset, start, min(n, len(rows) - start), rows) for seq_id, offset, n, start in chunks
                   if (rows := self.rows.get(seq_id)) is not None and start < len(rows)]
        if not covered:
            return None
        embeds = self.model.embed_input_ids(input_ids)  # [T, hidden]; every TP rank runs it (all-reduce)
        for offset, start, count, rows in covered:
            embeds[offset:offset + count] = rows[start:start + count]  # cast to the model's dtype here
        return embeds
