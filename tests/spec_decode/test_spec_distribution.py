"""Sampling with ngram drafts keeps the target distribution: the first four tokens of 4,000
samples against the exact joint probabilities from HF transformers, by a chi-square bound."""

from __future__ import annotations

import pytest
import torch

from tengyun import LLM, SamplingParams

# Tokens 7 and 9 biased far above the rest and top_k 2: nearly every output is 7 or 9, in
# proportions the random model sets (it likes runs: 9 9 9 9 has p .63, 7 7 7 7 .24). After the
# first output x1 the suffix [x1] is found in the prompt, so two drafts ([7, 9] after 7, [9, 9]
# after 9) are verified with x2 and x3, and when both hold x4 comes from the same step.
PROMPT = [7, 7, 9, 9]
BIAS = {7: 13.0, 9: 10.0}
TOP_K = 2
NUM_TOKENS = 4
NUM_SAMPLES = 4000
P_VALUE_Z = 3.09  # the normal quantile of p = 0.001 (the seeds are fixed: the test cannot flake)


def chi2_bound(df: int) -> float:
    """The chi-square quantile at 1 - 0.001 by Wilson-Hilferty (within 1% for df >= 3): df 7 -> 24.3."""
    return df * (1 - 2 / (9 * df) + P_VALUE_Z * (2 / (9 * df)) ** 0.5) ** 3


def chi2_pooled(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """(statistic, degrees of freedom); outcomes expected fewer than 5 times share one bin."""
    rare = [k for k, p in probs.items() if p * n < 5]
    bins = [([k], probs[k]) for k in probs if k not in rare] + [(rare, sum(probs[k] for k in rare))]
    stat = sum((sum(counts.get(k, 0) for k in keys) - n * p) ** 2 / (n * p) for keys, p in bins)
    return stat, len(bins) - 1


def _target_probs(logits: torch.Tensor) -> torch.Tensor:
    """[V] raw logits -> the sampler's distribution: + logit_bias, top-k, softmax (temperature 1)."""
    logits = logits.clone()
    for token, bias in BIAS.items():
        logits[token] += bias
    kth = logits.topk(TOP_K).values[-1]
    return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)


def _exact_joint(path) -> dict[tuple[int, ...], float]:
    """{(x1, .., x4): P(the first four outputs)} under the target model, from HF."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    joint = {(): 1.0}
    with torch.no_grad():
        for _ in range(NUM_TOKENS):
            longer = {}
            for prefix, p in joint.items():
                probs = _target_probs(model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1])
                for token in probs.nonzero().flatten().tolist():
                    longer[prefix + (token,)] = p * probs[token].item()
            joint = longer
    return joint


@pytest.mark.slow
def test_sampled_outputs_keep_the_target_distribution(tiny_checkpoints):
    path = str(tiny_checkpoints["llama"])
    joint = _exact_joint(path)
    llm = LLM(path, dtype="float32", block_size=8, max_model_len=64, max_num_seqs=256, seed=1234,
              kv_cache_memory="16MiB", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                           "prompt_lookup_min": 1, "prompt_lookup_max": 1})
    params = SamplingParams(n=NUM_SAMPLES, temperature=1.0, top_k=TOP_K, logit_bias=BIAS, max_tokens=NUM_TOKENS,
                            ignore_eos=True)
    outputs = llm.generate([PROMPT], params)[0].outputs
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_drafts >= NUM_SAMPLES and stats.num_accepted_tokens_per_pos[1] > NUM_SAMPLES / 20
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    counts = dict.fromkeys(joint, 0)
    for out in outputs:
        counts[tuple(out.token_ids)] += 1  # a KeyError: a sequence outside the target's support
    chi2, df = chi2_pooled(counts, joint, NUM_SAMPLES)
    assert df >= 5 and chi2 < chi2_bound(df), (chi2, df, counts, joint)


def test_chi2_bound_matches_the_table():
    assert chi2_bound(7) == pytest.approx(24.32, rel=0.01) and chi2_bound(15) == pytest.approx(37.70, rel=0.01)
