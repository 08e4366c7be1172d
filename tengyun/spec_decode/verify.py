"""Which drafts the target model accepts.

The standard rule (Leviathan et al. 2023; Chen et al. 2023) for draft d proposed with
probability q(d): accept with probability min(1, p(d) / q(d)); on rejection draw from
max(0, p - q), normalised; after K acceptances draw one more token from p. Tokens then follow
p exactly. Drafts here are point masses (ngram lookup; greedy MTP drafts): q = 1 at d. The
rule then reads: emit d with probability p(d), else a token x != d with probability
p(x) / (1 - p(d)), which is exactly "draw x ~ p, accept the draft iff x == d, and emit x".

So every verified position is sampled as an ordinary step would sample it (same filters,
penalties, and a seeded request's same per-step seed), and drafts are accepted while they
match: greedy output is the same tokens as without speculation, and a seeded request's
output does not depend on whether speculation is on.
"""

from __future__ import annotations


def accepted_tokens(drafts: list[int], sampled: list[int]) -> list[int]:
    """drafts [d1..dK], sampled [x0..xK] (x_j drawn at the position after d_j; x0 after the
    last known token) -> the new tokens: x0..xa where a drafts matched.
    [5, 7, 9], [5, 8, 9, 4] -> [5, 8]; [5, 7], [5, 7, 3] -> [5, 7, 3]; [], [6] -> [6]."""
    assert len(sampled) == len(drafts) + 1, (drafts, sampled)
    num_accepted = 0
    while num_accepted < len(drafts) and sampled[num_accepted] == drafts[num_accepted]:
        num_accepted += 1
    return sampled[:num_accepted + 1]
