"""Sampler: logits [B, V] -> one token per row, with vLLM's penalties, filters, seeds and logprobs.

Order of a step (as vLLM): raw logprobs -> logit_bias -> penalties -> min_tokens mask -> grammar
bitmask of constrained rows -> greedy argmax, or temperature -> top_k -> top_p -> min_p ->
inverse-CDF sampling with one uniform per row. (vLLM masks min_tokens before the bias and the
penalties; a -inf logit stays -inf through both, so the order of those three does not matter.)
Every stage that no row uses is skipped; an all-greedy batch is one argmax. Where the platform
has a fused last stage (``bind_kernels``: the CPU's compiled ``sample_rows``) and no row filters
with top_k / top_p / min_p, the argmax or the temperature-softmax-draw is that one kernel, reading
the logits in the model's dtype; after top_k / top_p it draws too (not with min_p). A batch whose
random rows all have a top_k works on those candidates instead of the vocabulary, and top_p ranks
only a row's best logits where they decide its cut (apply_top_p). Every path: the same uniform
per row, the same tokens up to rounding at a CDF step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tengyun.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, num_output_tokens: int) -> int:
    """Generator seed (uint64) for a seeded request's next token.

    A function of (seed, tokens generated so far) only: the draw is the same whatever else is
    in the batch, after an engine restart, and when a preempted request recomputes.
    Hash the seed, offset by the step, hash again, so nearby seeds give unrelated streams.
    """
    return _splitmix64((_splitmix64(seed & _MASK64) + num_output_tokens) & _MASK64)


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[[3, 1], [7]] -> [[3, 1], [7, pad]] as int64 on device; width 0 when all rows are empty."""
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out).to(device)


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs for the B rows that sample. A field is None when no row uses it."""

    temperature: torch.Tensor | None  # [B] float32, 1.0 on greedy rows; None when every row is 1.0
    is_greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int64 in [0, V], 0 = off
    max_top_k: int
    top_p: torch.Tensor | None  # [B] float32 in (0, 1]
    min_p: torch.Tensor | None  # [B] float32 in [0, 1]
    # Penalties: ids padded with V (a column that is dropped after scatter).
    prompt_token_ids: torch.Tensor | None  # [B, Lp] int64, empty rows where repetition_penalty == 1
    output_token_ids: torch.Tensor | None  # [B, Lo] int64
    repetition_penalty: torch.Tensor | None  # [B] float32
    presence_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None  # [B] float32
    # min_tokens: logits[min_tokens_rows[i], min_tokens_token_ids[i]] = -inf
    min_tokens_rows: torch.Tensor | None  # [N] int64
    min_tokens_token_ids: torch.Tensor | None  # [N] int64
    # logit_bias: logits[logit_bias_rows[i], logit_bias_token_ids[i]] += logit_bias_values[i]
    logit_bias_rows: torch.Tensor | None  # [M] int64
    logit_bias_token_ids: torch.Tensor | None  # [M] int64
    logit_bias_values: torch.Tensor | None  # [M] float32
    # Seeded random rows and their generator seeds for this step (step_seed).
    seeded_rows: list[int]
    step_seeds: list[int]
    max_num_logprobs: int | None  # max over rows of params.logprobs; None: no row wants logprobs
    # Structured output: the rows a grammar constrains and their allowed tokens, packed 32 per
    # int32 word (bit j of word w allows token 32 * w + j), as xgrammar fills them.
    bitmask_rows: torch.Tensor | None = None  # [N] int64
    token_bitmask: torch.Tensor | None = None  # [N, ceil(V / 32)] int32

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list,  # per row its output ids, or anything with len() where the row has no penalties
        vocab_size: int,
        device: torch.device,
        token_bitmask: tuple[list[int], torch.Tensor] | None = None,  # (rows, [N, ceil(V / 32)] int32)
    ) -> "SamplingMetadata":
        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).to(device)

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device)

        greedy = [p.is_greedy for p in params]
        # Filters only matter on random rows; greedy rows get the "off" value.
        top_k = [0 if g else min(p.top_k, vocab_size) for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]

        penalised = any(p.uses_penalties for p in params)
        if penalised:
            # Ids are only needed on rows that use them: keeps the padded width small.
            prompts = [ids if p.repetition_penalty != 1.0 else [] for p, ids in zip(params, prompt_token_ids)]
            outputs = [ids if p.uses_penalties else [] for p, ids in zip(params, output_token_ids)]

        mt_rows, mt_ids = _min_tokens_entries(params, output_token_ids, vocab_size)
        lb_rows, lb_ids, lb_values = _logit_bias_entries(params)
        temperatures = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        seeded = [i for i, (p, g) in enumerate(zip(params, greedy)) if not g and p.seed is not None]
        wants_logprobs = [p.logprobs for p in params if p.logprobs is not None]

        return cls(
            temperature=(floats(temperatures) if any(t != 1.0 for t in temperatures) else None),
            is_greedy=torch.tensor(greedy, dtype=torch.bool).to(device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=longs(top_k) if any(top_k) else None,
            max_top_k=max(top_k, default=0),
            top_p=floats(top_p) if any(p < 1.0 for p in top_p) else None,
            min_p=floats(min_p) if any(min_p) else None,
            prompt_token_ids=_pad(prompts, vocab_size, device) if penalised else None,
            output_token_ids=_pad(outputs, vocab_size, device) if penalised else None,
            repetition_penalty=floats([p.repetition_penalty for p in params]) if penalised else None,
            presence_penalty=floats([p.presence_penalty for p in params]) if penalised else None,
            frequency_penalty=floats([p.frequency_penalty for p in params]) if penalised else None,
            min_tokens_rows=longs(mt_rows) if mt_rows else None,
            min_tokens_token_ids=longs(mt_ids) if mt_rows else None,
            logit_bias_rows=longs(lb_rows) if lb_rows else None,
            logit_bias_token_ids=longs(lb_ids) if lb_rows else None,
            logit_bias_values=floats(lb_values) if lb_rows else None,
            seeded_rows=seeded,
            step_seeds=[step_seed(params[i].seed, len(output_token_ids[i])) for i in seeded],
            max_num_logprobs=min(max(wants_logprobs), vocab_size) if wants_logprobs else None,
            bitmask_rows=longs(token_bitmask[0]) if token_bitmask else None,
            token_bitmask=token_bitmask[1].to(device) if token_bitmask else None,
        )


def _min_tokens_entries(params: list[SamplingParams], output_token_ids: list[list[int]],
                        vocab_size: int) -> tuple[list[int], list[int]]:
    """(rows, token ids) masked while a row has fewer than min_tokens outputs: its stop tokens.
    Rows 0 and 2 below min_tokens with stops {2} and {2, 5} -> ([0, 2, 2], [2, 2, 5])."""
    rows: list[int] = []
    ids: list[int] = []
    for i, (p, out) in enumerate(zip(params, output_token_ids)):
        if len(out) < p.min_tokens:
            stops = sorted(t for t in p.all_stop_token_ids | set(p.stop_token_ids) if t < vocab_size)
            rows += [i] * len(stops)
            ids += stops
    return rows, ids


def _logit_bias_entries(params: list[SamplingParams]) -> tuple[list[int], list[int], list[float]]:
    """(rows, token ids, biases), one entry per biased token: row 1 {7: 5.0} -> ([1], [7], [5.0])."""
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows += [i] * len(p.logit_bias)
            ids += p.logit_bias.keys()
            values += p.logit_bias.values()
    return rows, ids, values


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprob_token_ids: torch.Tensor | None  # [B, 1 + max_k] int64: sampled token, then top-k
    logprobs: torch.Tensor | None  # [B, 1 + max_k] float32, same layout
    sampled_ranks: torch.Tensor | None  # [B] int64, 1 = most likely


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Out of place. Repetition over prompt + output ids; presence / frequency over output ids.

    Row with output [5, 5], presence 0.5, frequency 0.25: logits[:, 5] -= 0.5 + 2 * 0.25.
    """
    B, V = logits.shape
    out_ids = md.output_token_ids  # [B, Lo], pad = V
    counts = torch.zeros(B, V + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
    counts = counts[:, :V]  # [B, V]
    in_prompt = torch.zeros(B, V + 1, dtype=torch.bool, device=logits.device)
    in_prompt.scatter_(1, md.prompt_token_ids, True)
    seen = in_prompt[:, :V] | (counts > 0)  # [B, V]

    rep = torch.where(seen, md.repetition_penalty.unsqueeze(1), 1.0)  # [B, V]
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - md.frequency_penalty.unsqueeze(1) * counts
    return logits - md.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                     values: torch.Tensor) -> torch.Tensor:
    """Out of place: logits[rows[i], token_ids[i]] += values[i]; other entries untouched.

    [[1, 2, 3], [1, 2, 3]], rows [0, 0], ids [0, 2], values [5, -1] -> [[6, 2, 2], [1, 2, 3]]
    """
    return logits.index_put((rows, token_ids), values, accumulate=True)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Out of place: -inf on the tokens of `rows` whose bit is 0; other rows untouched.

    bitmask word 0b101 for V = 3 -> tokens 0 and 2 allowed, token 1 -> -inf.
    """
    V = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :V]  # [N, V]
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))


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


def _sample_random(logits: torch.Tensor, md: SamplingMetadata, sample_rows=None) -> torch.Tensor:
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


def gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, max_k: int):
    """logprobs [B, V], sampled [B] -> ids [B, 1 + max_k], logprobs [B, 1 + max_k], ranks [B];
    column 0 is the sampled (or, for prompt logprobs, the actual next) token."""
    sampled = sampled.unsqueeze(1)  # [B, 1]
    sampled_lp = logprobs.gather(1, sampled)  # [B, 1]
    ranks = (logprobs >= sampled_lp).sum(dim=-1)  # [B], as vLLM: ties rank after
    if max_k == 0:
        return sampled, sampled_lp, ranks
    top_lp, top_ids = logprobs.topk(max_k, dim=-1)  # descending
    return torch.cat([sampled, top_ids], dim=1), torch.cat([sampled_lp, top_lp], dim=1), ranks


def _processes_logits(md: SamplingMetadata) -> bool:
    """Whether a bias, penalty, min_tokens mask or grammar changes this step's logits."""
    return (md.logit_bias_rows is not None or md.output_token_ids is not None or md.min_tokens_rows is not None
            or md.token_bitmask is not None)


class Sampler(nn.Module):
    def __init__(self):
        super().__init__()
        self.sample_rows = None  # the platform's fused last stage (KernelBundle.sample_rows); None: PyTorch

    def bind_kernels(self, kernels) -> None:
        self.sample_rows = kernels.sample_rows

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits [B, V] in the model's dtype (not modified) -> SamplerOutput; logprobs and every
        stage but the fused one compute in float32."""
        md = metadata
        fused = self.sample_rows is not None and md.top_k is None and md.top_p is None and md.min_p is None
        if not fused or md.max_num_logprobs is not None or _processes_logits(md):
            logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None

        if md.logit_bias_rows is not None:
            logits = apply_logit_bias(logits, md.logit_bias_rows, md.logit_bias_token_ids, md.logit_bias_values)
        if md.output_token_ids is not None:
            logits = apply_penalties(logits, md)
        if md.min_tokens_rows is not None:
            neg_inf = logits.new_full((), float("-inf"))
            logits = logits.index_put((md.min_tokens_rows, md.min_tokens_token_ids), neg_inf)
        if md.token_bitmask is not None:
            logits = apply_token_bitmask(logits, md.bitmask_rows, md.token_bitmask)

        if fused:
            sampled = self.sample_rows(logits, md.temperature,
                                       None if md.all_greedy else uniform_draws(logits.shape[0], md, logits.device),
                                       None if md.all_greedy or md.all_random else md.is_greedy)
        elif md.all_greedy:
            sampled = logits.argmax(dim=-1)
        elif md.all_random:
            sampled = _sample_random(logits, md, self.sample_rows)
        else:
            sampled = torch.where(md.is_greedy, logits.argmax(dim=-1), _sample_random(logits, md, self.sample_rows))

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        ids, lps, ranks = gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled, ids, lps, ranks)
