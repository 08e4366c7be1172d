"""SamplingMetadata: one step's sampling inputs as tensors, built from the rows' SamplingParams.

A field is None when no row uses it, so the Sampler skips that stage. A seeded row's generator
seed for the step is step_seed(seed, tokens generated so far).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

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
