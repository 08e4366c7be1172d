"""NgramProposer: prompt-lookup drafts. The sequence's last n tokens (n from prompt_lookup_max
down to prompt_lookup_min) are searched for earlier in prompt + output; the tokens that
followed the first earlier occurrence are the drafts (as vLLM's: the first leaves the most
tokens to copy; in a run [7, 7, 7, 7] the latest would leave one).

tokens [1, 2, 3, 9, 1, 2], n = 2: suffix [1, 2] occurred at 0, followed by [3, 9, 1, ...]
-> drafts for k = 2: [3, 9].
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tengyun.spec_decode.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k drafts continuing ``token_ids`` (fewer near the end, [] without a match)."""
        if k < 1 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = _first_earlier_match(tokens, n)
            if start >= 0:
                return tokens[start + n:start + n + k].tolist()
        return []


def _first_earlier_match(tokens: np.ndarray, n: int) -> int:
    """Start of the first n-gram in tokens[:-1] equal to the last n tokens, or -1.
    [5, 1, 2, 1, 2], n = 2 -> windows of [5, 1, 2, 1] are [5,1], [1,2], [2,1] -> 1."""
    windows = sliding_window_view(tokens[:-1], n)  # [L - n, n]: every earlier n-gram
    hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
    return int(hits[0]) if hits.size else -1
