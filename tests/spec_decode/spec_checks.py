"""Checks the speculative-decoding tests share."""

from __future__ import annotations

import pytest


def assert_same_tokens_and_logprobs(without, with_spec) -> None:
    """Completion outputs with speculation equal those without: tokens, and per step the same
    top-logprob tokens with logprobs within 1e-4."""
    for expected, got in zip(without, with_spec):
        assert got.token_ids == expected.token_ids
        for e_step, g_step in zip(expected.logprobs, got.logprobs):
            assert list(g_step) == list(e_step)
            assert [x.logprob for x in g_step.values()] == pytest.approx([x.logprob for x in e_step.values()],
                                                                        abs=1e-4)
