"""ngram speculation with TP and PP worker processes (gloo): the ranks that do not sample roll
back rejected drafts as the sampling rank did (block tables; on hybrid models each rank's share
of the Gated DeltaNet state), so greedy tokens equal the single-process engine's without
speculation, under chunked prefill and preemption."""

from __future__ import annotations

import pytest

from tengyun import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[7, 7, 9, 7, 7, 9, 7], [9, 9, 9, 9, 9, 2, 9], [5, 17, 29, 41, 5, 17, 29, 41, 5, 17], list(range(10, 50))]
ENGINE_ARGS = dict(block_size=8, max_model_len=88, num_gpu_blocks_override=11, max_num_batched_tokens=16,
                   max_num_seqs=8)


def _generate(folder, bias, **engine_args):
    llm = LLM(str(folder), dtype="float32", **{**ENGINE_ARGS, **engine_args})
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias=bias if i % 2 == 0 else None)
              for i in range(len(PROMPTS))]
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)], llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.shutdown()


# Qwen3.5 at PP 4: the last stage (layer 3) has no linear-attention layer, yet rolls back by the
# hybrid rule (2-token blocks: accepted drafts often cross a block boundary before a rejection).
@pytest.mark.parametrize("arch,tp,pp,blocks", [("llama", 2, 1, {}), ("llama", 1, 2, {}), ("qwen3_5", 2, 1, {}),
                                               ("qwen3_5", 1, 2, {}),
                                               ("qwen3_5", 1, 4, dict(block_size=2, num_gpu_blocks_override=44))])
def test_parallel_speculation_gives_the_single_process_tokens(tiny_checkpoints, tiny_hybrid_checkpoints,
                                                              arch, tp, pp, blocks):
    folder = {**tiny_checkpoints, **tiny_hybrid_checkpoints}[arch]
    bias = {7: 6.0, 9: 6.0} if arch == "llama" else {7: 3.0, 9: 3.0}
    expected, _ = _generate(folder, bias, **blocks)
    got, stats = _generate(folder, bias, speculative_config=NGRAM, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                           **blocks)
    assert got == expected
    assert 0 < stats.spec_decode.num_accepted_tokens < stats.spec_decode.num_draft_tokens
    assert stats.num_preemptions > 0
