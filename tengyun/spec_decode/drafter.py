"""Drafter: the scheduler's side of speculative decoding: drafts for a decoding sequence, capped
so they fit its limits, and the counters of how many the target accepted. ngram drafts are
looked up here; mtp drafts come from the worker (Sequence.proposed_token_ids, set by the engine
after each step)."""

from __future__ import annotations

from tengyun.engine.sequence import Sequence
from tengyun.spec_decode.config import SpeculativeConfig
from tengyun.spec_decode.ngram import NgramProposer
from tengyun.spec_decode.stats import SpecDecodeStats


class Drafter:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.num_spec_tokens = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.ngram = NgramProposer(config) if config.method == "ngram" else None
        self.stats = SpecDecodeStats(self.num_spec_tokens)

    @classmethod
    def from_config(cls, config) -> "Drafter | None":
        """A Drafter for --speculative-config; None without speculation."""
        spec = config.speculative_config
        return cls(spec, config.max_model_len) if spec is not None else None

    def propose(self, seq: Sequence, budget: int) -> list[int]:
        """Drafts to follow a sequence's uncomputed tokens (its last one, in a decode): at most K,
        what the step's budget leaves after those tokens, and what its max_tokens and
        --max-model-len leave after the token the step samples anyway."""
        room = min(budget - seq.num_uncomputed_tokens, seq.sampling_params.max_tokens - seq.num_output_tokens - 1,
                   self.max_model_len - seq.num_tokens - 1)
        k = min(self.num_spec_tokens, room)
        if self.ngram is not None:
            return self.ngram.propose(seq.token_ids, k)
        drafts, seq.proposed_token_ids = seq.proposed_token_ids[:max(k, 0)], []
        return drafts
