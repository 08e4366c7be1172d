"""GrammarState: the worker's per-sequence grammar matchers for structured output.

A constrained sequence gets a matcher when the worker first sees it (NewSeqData); the matcher
accepts the outputs it already has (a sequence resumed after preemption resends them all), then
every token the sampler draws for it. Before each sampling step, the matchers of the rows that
sample fill one packed bitmask: bit j of word w allows token 32 * w + j. Free rows get no mask.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from tengyun.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class GrammarState:
    def __init__(self, compiler_factory: Callable[[], Any], vocab_size: int):
        self._compiler_factory = compiler_factory  # built on the first constrained sequence
        self._compiler: Any = None
        self.vocab_size = vocab_size
        self.matchers: dict[int, Any] = {}  # seq_id -> xgrammar.GrammarMatcher

    def add(self, seq_id: int, params: SamplingParams, output_token_ids: list[int]) -> None:
        """Start (or restart) seq_id's matcher and replay the outputs it already has."""
        self.matchers.pop(seq_id, None)
        if params.structured_outputs is None:
            return
        import xgrammar

        if self._compiler is None:
            self._compiler = self._compiler_factory()
        matcher = xgrammar.GrammarMatcher(self._compiler.compile(params.structured_outputs))
        self.matchers[seq_id] = matcher
        for token in output_token_ids:
            self.accept(seq_id, token)

    def discard(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)

    def accept(self, seq_id: int, token_id: int) -> None:
        matcher = self.matchers.get(seq_id)
        if matcher is None or matcher.is_terminated():
            return  # free, or past the grammar's end (ignore_eos): unconstrained from here
        if not matcher.accept_token(token_id):
            # Only reachable when a row had no allowed token (e.g. min_tokens masked the EOS the
            # grammar required): stop constraining rather than fail the batch.
            logger.warning("Sequence %d: token %d breaks its grammar; it is no longer constrained", seq_id,
                           token_id)
            self.matchers.pop(seq_id)

    def draft_bitmask(self, seq_ids: list[int], drafts: list[list[int]],
                      first_rows: list[int]) -> tuple[list[int], torch.Tensor] | None:
        """The bitmask of sampling rows where sequence i owns rows first_rows[i] .. + len(drafts[i]):
        row j is masked for the grammar's state after drafts[i][:j]. The matcher steps through the
        drafts and is rolled back. A draft the grammar refuses is sure to be rejected (the token
        sampled at its row is allowed), and the rows after it are never used: left free."""
        rows: list[int] = []
        masks: list[torch.Tensor] = []
        words = -(-self.vocab_size // 32)
        for seq_id, seq_drafts, first in zip(seq_ids, drafts, first_rows):
            matcher = self.matchers.get(seq_id)
            accepted = 0
            for j in range(len(seq_drafts) + 1):
                if matcher is None or matcher.is_terminated():
                    break
                mask = torch.empty(1, words, dtype=torch.int32)
                matcher.fill_next_token_bitmask(mask, 0)
                rows.append(first + j)
                masks.append(mask)
                if j == len(seq_drafts) or not matcher.accept_token(seq_drafts[j]):
                    break
                accepted += 1
            if accepted:
                matcher.rollback(accepted)
        return (rows, torch.cat(masks)) if rows else None

    def bitmask(self, seq_ids: list[int]) -> tuple[list[int], torch.Tensor] | None:
        """(rows, bitmask [len(rows), ceil(V / 32)] int32 on CPU) for the constrained rows of this
        batch, in logits row order; None when no row is constrained."""
        return self.draft_bitmask(seq_ids, [[] for _ in seq_ids], list(range(len(seq_ids))))
