"""ngram speculation on hybrid models (tiny Qwen3.5 dense and MoE): rejected drafts leave no
trace in the Gated DeltaNet state (the slot is restored and the accepted tokens recomputed), so
greedy tokens and logprobs equal those without speculation, under chunked prefill and
preemption, with prompts and a logit bias that make drafts both hold and fail."""

from __future__ import annotations

import pytest

from tengyun import LLM, SamplingParams

from spec_checks import assert_same_tokens_and_logprobs

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[7, 7, 9, 7, 7, 9, 7], [9, 9, 9, 9, 9, 2, 9], [5, 17, 29, 41, 5, 17, 29, 41, 5, 17], list(range(10, 50)),
           [100, 7, 101, 9, 102, 7, 103, 9]]
BIAS = {7: 3.0, 9: 3.0}
# 13 blocks of 8 tokens for 5 sequences of up to 60 tokens: preemption; 16 tokens a step: chunks.
SMALL = dict(block_size=8, max_model_len=104, num_gpu_blocks_override=13, max_num_batched_tokens=16, max_num_seqs=8)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_greedy_tokens_and_logprobs_identical_with_rejected_drafts(tiny_hybrid_checkpoints, arch):
    path = str(tiny_hybrid_checkpoints[arch])
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3,
                             logit_bias=BIAS if i % 2 == 0 else None) for i in range(len(PROMPTS))]
    outputs = {}
    for spec in (None, NGRAM):
        llm = LLM(path, dtype="float32", speculative_config=spec, **SMALL)
        outputs[spec is not None] = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    stats, engine_stats = llm.llm_engine.scheduler.spec_stats, llm.llm_engine.get_stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts held and failed
    assert engine_stats.num_preemptions > 0 and engine_stats.kv_cache_usage == 0.0
    pool = llm.llm_engine.scheduler.state_pool
    assert pool.num_free == pool.num_slots
    assert_same_tokens_and_logprobs(outputs[False], outputs[True])
