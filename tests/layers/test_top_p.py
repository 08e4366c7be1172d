"""apply_top_p's short paths (layers/sampler.py): rows narrowed by top_k, and rows whose best
TOP_P_CANDIDATES logits decide the cut, keep exactly the tokens the rule over every rank keeps
(float32 and bfloat16 logits, ties at the 256th, rows that fall back alone), and never rank the
whole row where the candidates decide."""

from __future__ import annotations

import pytest
import torch

from tengyun.layers.sampling.filters import apply_top_k, apply_top_p

NEG_INF = float("-inf")


def _top_p_written_out(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """apply_top_p's rule over every rank, written out: rank the row (descending, ties by
    column), keep a token while the probability ranked above it sums below top_p."""
    order = logits.sort(dim=-1, descending=True, stable=True).indices
    ranked = logits.softmax(dim=-1).gather(1, order)
    above = ranked.cumsum(dim=-1) - ranked
    drop = above >= top_p.unsqueeze(1)
    drop[:, 0] = False
    return torch.empty_like(logits).scatter_(1, order, logits.gather(1, order).masked_fill(drop, NEG_INF))


def _kept_equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got > NEG_INF, want > NEG_INF) and torch.equal(got[got > NEG_INF], want[want > NEG_INF])


def test_top_p_after_top_k_ranks_only_the_kept_logits_and_keeps_the_same_tokens(monkeypatch):
    """Rows narrowed by top_k take apply_top_p's short path (a topk of the finite logits, never the
    whole row ranked); it keeps exactly the tokens the rule over every rank keeps."""
    import tengyun.layers.sampling.filters as sampler

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 4000, generator=gen) * 3
    narrowed = apply_top_k(logits, torch.tensor([20, 5, 1, 20, 13, 2]), max_top_k=20)
    top_p = torch.tensor([0.8, 0.5, 0.9, 1.0, 0.05, 0.6])
    monkeypatch.setattr(sampler, "_all_columns", lambda _: pytest.fail("ranked the whole row"))
    assert _kept_equal(apply_top_p(narrowed, top_p), _top_p_written_out(narrowed, top_p))


@pytest.mark.parametrize("seed", range(4))
def test_top_p_alone_ranks_the_best_candidates_where_they_reach_p(monkeypatch, seed):
    """Without top_k, rows whose best TOP_P_CANDIDATES weigh top_p rank only those (never the
    whole row); the kept tokens equal the rule over every rank. Rows that do not reach p, or whose
    tie at the 256th reaches past the candidates, rank all their logits (those rows alone): the
    same rule, the same tokens."""
    import tengyun.layers.sampling.filters as sampler

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, 5000, generator=gen) * 4  # peaked: the best 256 weigh ~0.9
    top_p = torch.rand(8, generator=gen) * 0.6 + 0.2
    with monkeypatch.context() as patch:
        patch.setattr(sampler, "_all_columns", lambda _: pytest.fail("ranked the whole row"))
        assert _kept_equal(apply_top_p(logits, top_p), _top_p_written_out(logits, top_p))
    ranked_rows = []
    real = sampler._all_columns
    monkeypatch.setattr(sampler, "_all_columns", lambda x: ranked_rows.append(x.shape[0]) or real(x))
    mixed = logits.clone()
    mixed[[2, 5]] = torch.randn(2, 5000, generator=gen) * 0.1  # these rows' best 256 weigh ~5%
    assert _kept_equal(apply_top_p(mixed, top_p), _top_p_written_out(mixed, top_p))
    tied = logits.clone()
    best = tied[0].topk(sampler.TOP_P_CANDIDATES + 1).indices
    tied[0, best[-1]] = tied[0, best[-2]]  # the 256th and 257th best logits equal
    assert _kept_equal(apply_top_p(tied, top_p), _top_p_written_out(tied, top_p))
    assert ranked_rows == [2]  # the two flat rows alone; the tie at the 256th stays among the candidates
    monkeypatch.setattr(sampler, "_TIE_SLACK", 1)
    assert _kept_equal(apply_top_p(tied, top_p), _top_p_written_out(tied, top_p))
    assert ranked_rows == [2, 1]  # a tie reaching past the candidates: that row ranks all


def test_top_p_on_a_batch_mixing_top_k_rows_ranks_no_whole_row(monkeypatch):
    """A row narrowed by its top_k beside rows without one: its few finite logits are all among
    the candidates, so it takes the short path too; the same kept tokens as the rule."""
    import tengyun.layers.sampling.filters as sampler

    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 5000, generator=gen) * 4
    logits = apply_top_k(logits, torch.tensor([5000, 20, 5000, 3]), max_top_k=5000)
    top_p = torch.tensor([0.5, 0.9, 0.6, 0.95])
    monkeypatch.setattr(sampler, "_all_columns", lambda _: pytest.fail("ranked the whole row"))
    got = apply_top_p(logits, top_p)
    monkeypatch.undo()
    assert _kept_equal(got, _top_p_written_out(logits, top_p))


def test_top_p_alone_on_bfloat16_logits_keeps_their_ties_among_the_candidates(monkeypatch):
    """bfloat16 logits widened (the sampler's input in bf16 models): many equal values around the
    256th best; the candidates reach past them, so no row ranks all its logits, and ties at the cut
    are ordered by column as the rule over every rank orders them."""
    import tengyun.layers.sampling.filters as sampler

    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(16, 49152, generator=gen) * 4).bfloat16().float()
    top_p = torch.rand(16, generator=gen) * 0.5 + 0.2
    monkeypatch.setattr(sampler, "_all_columns", lambda _: pytest.fail("ranked the whole row"))
    got = apply_top_p(logits, top_p)
    monkeypatch.undo()
    assert _kept_equal(got, _top_p_written_out(logits, top_p))
