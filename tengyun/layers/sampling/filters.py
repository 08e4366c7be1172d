"""The filters a random row's logits pass before the draw: top_k, top_p, min_p.

top_p ranks only a row's best logits where they decide its cut (apply_top_p): the same kept
tokens as ranking the whole row.
"""

from __future__ import annotations

import torch


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's top_k largest logits (ties with the k-th kept); top_k 0 keeps all."""
    kth = logits.topk(max_top_k, dim=-1).values  # [B, max_k], descending
    thresh = kth.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))  # [B, 1]
    thresh = thresh.masked_fill((top_k == 0).unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < thresh, float("-inf"))


# The most likely tokens apply_top_p ranks first; a row whose top_p they do not reach ranks all
# (64 x 49152 float32, 2 threads: a topk of 320 ~6 ms, the stable sort of every logit ~140 ms).
TOP_P_CANDIDATES = 256
# Logits taken past the best TOP_P_CANDIDATES, so that the logits tied with the 256th stay among
# them (bfloat16 logits: ~14 share each representable value there, for 49152 randn x 3 logits).
_TIE_SLACK = 64


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the fewest most-likely tokens whose probability sums to >= top_p: a token stays while
    the tokens ranked above it weigh less than top_p (the most likely always stays).

    probs [.5, .3, .15, .05], top_p .75: weight above each [0, .5, .8, .95] -> keep {.5, .3}.

    Ranks order equal logits by column (a stable sort), the probabilities are the row's softmax,
    and the weight above a rank is a running sum from the top: the first ranks get the same sums
    whether the rest of the row was ranked or not. So only the best are ranked where that decides
    every token: rows narrowed by top_k (their finite logits; Qwen's generation_config asks for
    top_k 20 with top_p 0.8), and rows whose logits >= their TOP_P_CANDIDATES-th best already weigh
    top_p (every other token has at least that much above it); the other rows rank all their
    logits (SmolLM2 at temperature 0.7: the best 256 reach 0.95 at 96% of positions, at 1.0 69%).
    """
    n = logits.shape[1]
    probs = logits.softmax(dim=-1)  # [B, N]
    finite = int((logits > float("-inf")).sum(dim=-1).max())
    if finite * 8 <= n:  # the best `finite` of a row hold all its finite logits; the rest weigh 0
        return _top_p_ranked(logits, probs, _ranked(logits, logits.topk(max(finite, 1), dim=-1).indices), top_p)[0]
    width = TOP_P_CANDIDATES + _TIE_SLACK
    if width >= n:
        return _top_p_ranked(logits, probs, _all_columns(logits), top_p)[0]
    values, picked = logits.topk(width, dim=-1)  # [B, width], descending
    kth = values[:, TOP_P_CANDIDATES - 1:TOP_P_CANDIDATES]  # [B, 1]
    decided = (values >= kth).sum(dim=-1)  # [B] exact ranks
    columns = _ranked(logits, picked)
    out, cum = _top_p_ranked(logits, probs, columns, top_p)
    # exact: every logit >= the 256th is among the candidates, or (a row top_k narrowed, in a batch
    # with rows it did not) the row has fewer finite logits, all among them
    exact = (decided < width) | (kth.squeeze(1) == float("-inf"))
    short = exact & (cum.gather(1, (decided - 1).unsqueeze(1)).squeeze(1) >= top_p)
    if bool(short.all()):
        return out
    rest = (~short).nonzero().squeeze(1)  # their tie or top_p reaches past the candidates: every rank
    out[rest] = _top_p_ranked(logits[rest], probs[rest], _all_columns(logits[rest]), top_p[rest])[0]
    return out


def _all_columns(logits: torch.Tensor) -> torch.Tensor:
    """[B, N] -> every column by rank (descending, equal logits by column)."""
    return logits.sort(dim=-1, descending=True, stable=True).indices


def _ranked(logits: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """Columns [B, K] (a topk's) -> the same columns by rank (descending, equal logits by column)."""
    columns = picked.sort(dim=-1).values
    return columns.gather(1, logits.gather(1, columns).sort(dim=-1, descending=True, stable=True).indices)


def _top_p_ranked(logits: torch.Tensor, probs: torch.Tensor, columns: torch.Tensor,
                  top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_top_p's rule on the ranks ``columns`` [B, K] gives (a token stays while the ranks
    above it weigh below top_p; rank 0 always) -> (the logits, -inf where dropped or not ranked;
    the ranks' running sum of probabilities [B, K])."""
    ranked = probs.gather(1, columns)
    cum = ranked.cumsum(dim=-1)
    keep = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1) < top_p.unsqueeze(1)
    keep[:, 0] = True
    out = torch.full_like(logits, float("-inf"))
    return out.scatter_(1, columns, logits.gather(1, columns).masked_fill_(~keep, float("-inf"))), cum


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities below min_p * (the row's largest). Not renormalised."""
    thresh = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [B, 1]
    return probs.masked_fill(probs < thresh, 0.0)
