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

import torch
from torch import nn

from tengyun.layers.sampling.draw import sample_random, uniform_draws
from tengyun.layers.sampling.logprobs import gather_logprobs
from tengyun.layers.sampling.metadata import SamplingMetadata
from tengyun.layers.sampling.penalties import apply_logit_bias, apply_penalties
from tengyun.layers.sampling.token_bitmask import apply_token_bitmask


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprob_token_ids: torch.Tensor | None  # [B, 1 + max_k] int64: sampled token, then top-k
    logprobs: torch.Tensor | None  # [B, 1 + max_k] float32, same layout
    sampled_ranks: torch.Tensor | None  # [B] int64, 1 = most likely


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
            sampled = sample_random(logits, md, self.sample_rows)
        else:
            sampled = torch.where(md.is_greedy, logits.argmax(dim=-1), sample_random(logits, md, self.sample_rows))

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        ids, lps, ranks = gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled, ids, lps, ranks)
