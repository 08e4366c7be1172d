"""SpecDecodeStats: counters of drafts proposed and accepted, as vLLM's spec_decode metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_spec_tokens: int  # K: drafts per verification at most
    num_drafts: int = 0  # verifications (a sequence with >= 1 draft in a step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [K]: how often the draft at position i (0-based) was accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence's verification: drafts 0..num_accepted-1 of num_draft_tokens accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def snapshot(self) -> "SpecDecodeStats":
        return SpecDecodeStats(self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
                               self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos))
