"""The draw of the random rows: temperature and the filters, then inverse-CDF sampling with one
uniform per row (a seeded row's from its step seed).

A batch whose random rows all have a top_k works on those candidates instead of the vocabulary
(_top_k_candidates); either path draws the same token from the same uniform, up to rounding at a
CDF step.
"""

from __future__ import annotations

import torch

from tengyun.layers.sampling.filters import apply_min_p, apply_top_k, apply_top_p
from tengyun.layers.sampling.metadata import SamplingMetadata


def uniform_draws(batch: int, md: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """[B] float64 in [0, 1): one global-RNG draw, then each seeded row redrawn from its seed."""
    u = torch.rand(batch, dtype=torch.float64, device=device)
    if md.seeded_rows:
        gen = torch.Generator(device=device)
        for row, seed in zip(md.seeded_rows, md.step_seeds):
            gen.manual_seed(seed)
            u[row] = torch.rand(1, dtype=torch.float64, device=device, generator=gen)[0]
    return u


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [B, V] (>= 0, need not sum to 1), u [B] -> [B] tokens.

    One uniform per row instead of V exponentials (60 ms -> 2 ms for 64 x 49152 on CPU).
    Zero-probability tokens are never picked: the CDF is flat across them.
    e.g. probs [0.2, 0, 0.8], u 0.5 -> cdf [0.2, 0.2, 1.0], target 0.5 -> token 2
    """
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
    overflow = tokens >= probs.shape[1]  # target rounded up to the total (u within 1e-16 of 1)
    if overflow.any():
        last_nonzero = probs.shape[1] - 1 - (probs[overflow].flip(-1) > 0).to(torch.int8).argmax(dim=-1)
        tokens[overflow] = last_nonzero
    return tokens


def sample_random(logits: torch.Tensor, md: SamplingMetadata, sample_rows=None) -> torch.Tensor:
    """[B, V] penalised logits -> [B] tokens for the random rows (greedy rows' values are junk):
    on the top_k candidates where every random row has one, else on the whole vocabulary,
    where sample_rows (the platform's fused draw) draws after the filters unless min_p is set."""
    candidates = _top_k_candidates(logits, md)
    if candidates is not None:
        return _sample_candidates(*candidates, md)
    return _sample_vocabulary(logits, md, sample_rows)


def _top_k_candidates(logits: torch.Tensor, md: SamplingMetadata):
    """When every random row has a top_k: (the best logits of every row [B, N] descending,
    divided by the temperature, and their ids [B, N]), N = max_top_k, or more where a tie at a
    row's k-th logit reaches past it (apply_top_k keeps every tie); None where a random row has no
    top_k (the full rows are needed)."""
    if md.top_k is None:
        return None
    random_rows = ~md.is_greedy
    if not bool((md.top_k > 0)[random_rows].all()):
        return None
    vals, ids = logits.topk(min(md.max_top_k + 1, logits.shape[1]), dim=-1)  # logits / t: the same order
    kth = vals.gather(1, (md.top_k - 1).clamp(min=0).unsqueeze(1))  # [B, 1]
    if vals.shape[1] > md.max_top_k:
        if bool((vals[:, -1:] >= kth)[random_rows].any()):  # ties past the K-th: take them all
            vals, ids = logits.topk(int((logits >= kth).sum(dim=-1)[random_rows].max()), dim=-1)
        else:
            vals, ids = vals[:, :-1], ids[:, :-1]
    if md.temperature is not None:
        vals = vals / md.temperature.unsqueeze(1)
    return vals, ids


def _sample_candidates(vals: torch.Tensor, ids: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """_sample_vocabulary on the candidates (already divided by the temperature): the other logits
    are -inf after top_k, so the filters see the same probabilities, and the draw walks the
    candidates in token-id order, as the vocabulary's CDF does: the same uniform, the same token
    (a seeded row's draw does not depend on which path its batch takes)."""
    ids, by_id = ids.sort(dim=-1)  # columns in token-id order: apply_top_p's ties, and the CDF
    vals = apply_top_k(vals.gather(1, by_id), md.top_k, md.max_top_k)
    if md.top_p is not None:
        vals = apply_top_p(vals, md.top_p)
    probs = vals.softmax(dim=-1)
    if md.min_p is not None:
        probs = apply_min_p(probs, md.min_p)
    position = sample_from_probs(probs, uniform_draws(probs.shape[0], md, probs.device))
    return ids.gather(1, position.unsqueeze(1)).squeeze(1)


def _sample_vocabulary(logits: torch.Tensor, md: SamplingMetadata, sample_rows=None) -> torch.Tensor:
    """_sample_random over the whole vocabulary."""
    if md.temperature is not None:
        logits = logits / md.temperature.unsqueeze(1)
    if md.top_k is not None:
        logits = apply_top_k(logits, md.top_k, md.max_top_k)
    if md.top_p is not None:
        logits = apply_top_p(logits, md.top_p)
    if sample_rows is not None and md.min_p is None:  # the inverse CDF of softmax(logits); -inf weighs 0
        return sample_rows(logits, None, uniform_draws(logits.shape[0], md, logits.device), None)
    probs = logits.softmax(dim=-1)
    if md.min_p is not None:
        probs = apply_min_p(probs, md.min_p)
    return sample_from_probs(probs, uniform_draws(probs.shape[0], md, probs.device))
