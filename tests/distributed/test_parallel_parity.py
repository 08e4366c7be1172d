"""Tensor and pipeline parallelism with real worker processes over gloo: greedy tokens and
top-5 logprobs equal the single-process engine's, under chunked prefill and preemption."""

from __future__ import annotations

import logging
import random

import pytest

from tengyun import LLM, SamplingParams

logger = logging.getLogger(__name__)

MAX_TOKENS = 10
TOP_K = 5
ENGINE_ARGS = dict(block_size=8, max_model_len=104, num_gpu_blocks_override=13,  # preemption must happen
                   max_num_batched_tokens=32, max_num_seqs=16)


def _prompts() -> list[list[int]]:
    """6 prompts of 3..70 tokens, three sharing a 20-token prefix; two longer than the 32-token budget."""
    rng = random.Random(1)
    shared = [rng.randrange(1, 300) for _ in range(20)]
    prompts = [[rng.randrange(1, 300) for _ in range(n)] for n in (3, 40, 70)]
    return prompts + [shared + [rng.randrange(1, 300) for _ in range(n)] for n in (4, 9, 15)]


def _generate(folder, **parallel) -> tuple[list, object]:
    llm = LLM(str(folder), dtype="float32", **ENGINE_ARGS, **parallel)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    try:
        outputs = [o.outputs[0] for o in llm.generate(_prompts(), params)]
        stats = llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.shutdown()
    return outputs, stats


_reference: dict = {}


def _single_process(folder):
    if folder not in _reference:
        _reference[folder] = _generate(folder)[0]
    return _reference[folder]


@pytest.mark.parametrize("arch,tp,pp", [
    ("llama", 2, 1), ("llama", 1, 2), ("llama", 2, 2),
    ("qwen3", 2, 1), ("qwen3", 1, 2), ("qwen3", 2, 2),
    ("qwen2", 2, 1), ("qwen2", 1, 2),  # tied embeddings: the last stage's head loads embed_tokens
    ("qwen3_moe", 2, 1), ("qwen3_moe", 1, 2),  # TP: each rank holds half the experts
    # Hybrid: TP splits the Gated DeltaNet heads and its state; PP=2 puts layers 0-1 (linear
    # attention only, no KV cache) on stage 0 and layers 2-3 (one of each) on stage 1.
    ("qwen3_5", 2, 1), ("qwen3_5", 1, 2), ("qwen3_5", 2, 2),
    ("qwen3_5_moe", 2, 1), ("qwen3_5_moe", 1, 2),
])
def test_parallel_greedy_matches_single_process(tiny_checkpoints, tiny_hybrid_checkpoints, arch, tp, pp):
    folder = {**tiny_checkpoints, **tiny_hybrid_checkpoints}[arch]
    reference = _single_process(folder)
    outputs, stats = _generate(folder, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert stats.num_preemptions > 0
    if arch.startswith("qwen3_5"):  # every rank restores its own layers' state snapshots
        assert stats.prefix_cache_hits > 0
    for got, want in zip(outputs, reference):
        assert got.token_ids == want.token_ids
        for step, (got_top, want_top) in enumerate(zip(got.logprobs, want.logprobs)):
            for token, entry in want_top.items():
                assert got_top[token].logprob == pytest.approx(entry.logprob, abs=1e-4), (step, token)


def test_tp_larger_than_kv_heads_replicates_kv_heads(tmp_path, tiny_tokenizer_dir):
    from conftest import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path, tiny_tokenizer_dir, "llama", num_key_value_heads=1)
    reference, _ = _generate(folder)
    outputs, _ = _generate(folder, tensor_parallel_size=2)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]


def test_tp2_halves_weight_bytes_per_rank(tmp_path, tiny_tokenizer_dir):
    from conftest import make_tiny_checkpoint

    # Wider than the default tiny model so replicated norms are a small share, as in real models.
    folder = make_tiny_checkpoint(tmp_path, tiny_tokenizer_dir, "llama", hidden_size=256, intermediate_size=512)
    single = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB", max_model_len=128)
    tp1_bytes = single.llm_engine.executor.weight_bytes
    tp2 = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB", max_model_len=128, tensor_parallel_size=2)
    try:
        per_rank = tp2.llm_engine.executor.weight_bytes
    finally:
        tp2.llm_engine.shutdown()
    ratios = {rank: nbytes / tp1_bytes for rank, nbytes in per_rank.items()}
    message = (f"weight bytes: TP=1 {tp1_bytes / 2**20:.2f} MiB; TP=2 per rank "
               + ", ".join(f"rank {r} {b / 2**20:.2f} MiB ({ratios[r]:.3f} of TP=1)" for r, b in per_rank.items()))
    logger.warning(message)
    print(message)
    assert sorted(per_rank) == [0, 1]
    assert all(0.45 < ratio < 0.55 for ratio in ratios.values()), message


def test_hybrid_tp2_sizes_state_slots_and_blocks_per_rank(tiny_hybrid_checkpoints):
    """Each TP=2 rank holds half the KV heads and half the recurrent state per sequence, so a
    per-rank budget B gives what TP=1 gets from 2B (budgets tight enough that both limits bind)."""
    folder = str(tiny_hybrid_checkpoints["qwen3_5"])
    args = dict(block_size=8, max_model_len=104, max_num_seqs=32)
    single = LLM(folder, dtype="float32", kv_cache_memory="128KiB", **args).llm_engine.executor
    tp2 = LLM(folder, dtype="float32", kv_cache_memory="64KiB", tensor_parallel_size=2, **args).llm_engine
    try:
        got = (tp2.executor.num_blocks, tp2.executor.num_state_slots)
    finally:
        tp2.shutdown()
    assert got == (single.num_blocks, single.num_state_slots)
    assert 1 < single.num_state_slots < 32  # the budget, not max_num_seqs, set the slot count
