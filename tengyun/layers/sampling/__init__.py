"""The sampler's parts, one stage each; the Sampler itself (the order of a step) is layers/sampler.py.

metadata.py   SamplingMetadata: per-step tensors for the rows that sample, built from their params
penalties.py  logit_bias and the repetition / presence / frequency penalties
token_bitmask.py  a grammar's allowed tokens, 32 per int32 word
filters.py    top_k, top_p (ranking only the best logits where they decide), min_p
draw.py       one uniform per row (seeded rows from their seed) and the inverse-CDF draw
logprobs.py   the sampled token's logprob and rank beside the top-k
"""
