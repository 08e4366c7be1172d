"""Prompt embeddings under tensor parallelism with real worker processes over gloo: the rows reach
every TP rank (each embeds the batch's token ids through its vocabulary shard, then swaps in the
prompt rows), and greedy tokens and logprobs equal the single-process engine's, in a batch mixed
with a token-id prompt, under chunked prefill."""

from __future__ import annotations

import pytest
import torch

from tengyun import LLM, SamplingParams

IDS = [5, 17, 33, 99, 120, 7, 8, 250, 3, 44, 61, 9, 9, 31, 200, 4, 77, 150, 2, 18]
ENGINE = dict(dtype="float32", max_model_len=64, block_size=8, max_num_batched_tokens=8, enable_prompt_embeds=True)


def _generate(folder, embeds: torch.Tensor, **parallel):
    llm = LLM(str(folder), **ENGINE, **parallel)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    try:
        return [o.outputs[0] for o in llm.generate([{"prompt_embeds": embeds}, IDS[:7]], params)]
    finally:
        llm.llm_engine.shutdown()


def test_tp2_prompt_embeds_equal_single_process(tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    folder = tiny_checkpoints["qwen3"]
    embeds = AutoModelForCausalLM.from_pretrained(folder).get_input_embeddings()(torch.tensor(IDS)).detach()
    single = _generate(folder, embeds)
    parallel = _generate(folder, embeds, tensor_parallel_size=2)
    for one, two in zip(single, parallel):
        assert two.token_ids == one.token_ids
        for a, b in zip(one.logprobs, two.logprobs):
            assert sorted(a) == sorted(b)
            for token in a:
                assert b[token].logprob == pytest.approx(a[token].logprob, abs=1e-4)
