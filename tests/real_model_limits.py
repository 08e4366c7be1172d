"""Engine limits for the tests that run the real small models (SmolLM2-135M, Qwen2.5-Coder-0.5B).

Their runs hold at most 8 sequences and 512 tokens in a step, and the engine sizes its start-up
work by these limits: decode graphs for batches 1-8 (11 sizes up to 64 by default), and a
profile step of 512 tokens over 8 sequences (by default 2048 over 256: 12.5-13.9 s for
Qwen2.5-Coder in float32 on a 2-core AMD EPYC VM, 8.8-9.3 s with 2048 over 8).
"""

REAL_MODEL_LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=512)
