"""Speculative decoding: the config, draft proposers and acceptance counters (pure Python, no torch).

The tensor side (verifying drafts against the target's probabilities) lives in
tengyun/layers/rejection_sampler.py; docs/speculative_decoding.md describes the whole step.
"""
