"""Prompt embeddings (LLM(enable_prompt_embeds=True), {"prompt_embeds": tensor}): HF's own input
embeddings fed back give the same greedy tokens and logprobs as the same prompt as token ids and as
HF transformers' generate(inputs_embeds=...), in a batch mixed with token-id prompts, under chunked
prefill and prefix caching; bad tensors are refused naming the field, with nothing queued."""

from __future__ import annotations

import pytest
import torch

from tengyun import LLM, SamplingParams

MAX_TOKENS = 8
PROMPTS = [[5, 17, 33, 99, 120, 7, 8, 250, 3, 44, 61], [9, 9, 31, 200, 4, 77, 150, 2, 18, 19, 20, 21, 22, 23, 24,
                                                           25, 26, 27, 28, 29, 30]]
ENGINE = dict(dtype="float32", max_model_len=128, block_size=8, max_num_batched_tokens=16,  # 21 rows: 2 chunks
              enable_prefix_caching=True, enable_prompt_embeds=True)


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _hf_generate(model, embeds: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
    """HF's greedy tokens from generate(inputs_embeds=...), and each step's log-softmax recomputed in
    full over the prompt's embeddings and the tokens so far (generate's cached steps differ by ~1e-4)."""
    with torch.no_grad():
        out = model.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, len(embeds), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        tokens = out[0, -MAX_TOKENS:].tolist()
        logprobs = []
        for step in range(MAX_TOKENS):
            rows = torch.cat([embeds, model.get_input_embeddings()(torch.tensor(tokens[:step], dtype=torch.long))])
            logprobs.append(model(inputs_embeds=rows[None]).logits[0, -1].float().log_softmax(-1))
    return tokens, logprobs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prompt_embeds_equal_token_ids_and_hf_inputs_embeds(tiny_checkpoints, arch):
    folder = tiny_checkpoints[arch]
    model = _hf(folder)
    embeds = [model.get_input_embeddings()(torch.tensor(ids)).detach() for ids in PROMPTS]
    llm = LLM(str(folder), **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    # One batch: embeddings and token ids interleaved, the 21-row prompt split over two steps.
    outputs = llm.generate([{"prompt_embeds": embeds[0]}, PROMPTS[0], {"prompt_embeds": embeds[1]}, PROMPTS[1]],
                           params)
    for k, ids in enumerate(PROMPTS):
        from_embeds, from_ids = outputs[2 * k], outputs[2 * k + 1]
        ref_tokens, ref_logprobs = _hf_generate(model, embeds[k])
        assert from_embeds.outputs[0].token_ids == from_ids.outputs[0].token_ids == ref_tokens
        assert from_embeds.prompt_token_ids == [0] * len(ids)  # placeholders, as vLLM reports them
        assert from_embeds.prompt is None
        for step, token in enumerate(ref_tokens):
            got = from_embeds.outputs[0].logprobs[step][token].logprob
            assert got == pytest.approx(ref_logprobs[step][token].item(), abs=1e-4)
            assert got == pytest.approx(from_ids.outputs[0].logprobs[step][token].logprob, abs=1e-5)
        assert from_embeds.outputs[0].text == from_ids.outputs[0].text


NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


@pytest.fixture(scope="module")
def qwen3_llm(tiny_checkpoints):
    """One engine for the tests below, with n-gram speculation on (drafts after an embeddings prompt)."""
    return LLM(str(tiny_checkpoints["qwen3"]), **ENGINE, speculative_config=NGRAM)


def _embeds(folder, ids) -> torch.Tensor:
    return _hf(folder).get_input_embeddings()(torch.tensor(ids)).detach()


def test_prompt_embeds_bypass_the_prefix_cache(tiny_checkpoints, qwen3_llm):
    """Neither looked up nor cached: the same embeddings twice compute twice, and a token-id prompt
    of the placeholder ids (all 0) finds no block an embeddings prompt wrote."""
    embeds = _embeds(tiny_checkpoints["qwen3"], PROMPTS[1])
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first, = qwen3_llm.generate({"prompt_embeds": embeds}, params)
    second, = qwen3_llm.generate({"prompt_embeds": embeds}, params)
    zeros, = qwen3_llm.generate([0] * len(PROMPTS[1]), params)
    assert (first.num_cached_tokens, second.num_cached_tokens, zeros.num_cached_tokens) == (0, 0, 0)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    again, = qwen3_llm.generate([0] * len(PROMPTS[1]), params)  # the control: token ids do hit
    assert again.num_cached_tokens == 16


def test_ngram_drafts_and_batched_or_bfloat16_embeds(tiny_checkpoints, qwen3_llm):
    """n-gram drafts after an embeddings prompt are verified as any (same tokens as the ids);
    [1, seq_len, hidden] is squeezed (as vLLM); bfloat16 rows are cast to the model's dtype."""
    embeds = _embeds(tiny_checkpoints["qwen3"], PROMPTS[1])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids, plain, batched, bf16, bf16_as_fp32 = qwen3_llm.generate(
        [PROMPTS[1], {"prompt_embeds": embeds}, {"prompt_embeds": embeds[None]},
         {"prompt_embeds": embeds.bfloat16()}, {"prompt_embeds": embeds.bfloat16().float()}], params)
    assert ids.outputs[0].token_ids == plain.outputs[0].token_ids == batched.outputs[0].token_ids
    assert bf16.outputs[0].token_ids == bf16_as_fp32.outputs[0].token_ids


@pytest.mark.parametrize("embeds, match", [
    (torch.zeros(4, 32), "hidden size 32 but the model's is 64"),
    (torch.zeros(4, 64, dtype=torch.int64), "prompt_embeds must be float32, bfloat16 or float16"),
    (torch.zeros(2, 4, 64), r"prompt_embeds must be of shape \(seq_len, hidden_size\)"),
    (torch.zeros(0, 64), "at least one row"),
    (torch.zeros(128, 64), "--max-model-len"),
    ([[0.0] * 64], "must be a torch.Tensor"),
])
def test_bad_prompt_embeds_are_refused_and_nothing_is_queued(qwen3_llm, embeds, match):
    with pytest.raises(ValueError, match=match):
        qwen3_llm.generate([[1, 2, 3], {"prompt_embeds": embeds}], SamplingParams(max_tokens=2))
    assert not qwen3_llm.llm_engine.has_unfinished_requests()
    assert qwen3_llm.llm_engine.scheduler.block_manager.usage == 0.0


def test_prompt_logprobs_with_embeds_are_refused_as_vllm(qwen3_llm):
    with pytest.raises(ValueError, match="prompt_logprobs is not compatible with prompt embeds"):
        qwen3_llm.generate({"prompt_embeds": torch.zeros(3, 64)}, SamplingParams(max_tokens=2, prompt_logprobs=1))


def test_without_the_flag_embeds_are_refused_naming_it(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["qwen3"]), **{**ENGINE, "enable_prompt_embeds": False})
    with pytest.raises(ValueError, match="You must set `--enable-prompt-embeds` to input `prompt_embeds`"):
        llm.generate({"prompt_embeds": torch.zeros(3, 64)}, SamplingParams(max_tokens=2))


def test_hybrid_model_runs_embeds_as_token_ids(tiny_hybrid_checkpoints):
    """Qwen3.5 (Gated DeltaNet state, hybrid prefix caching on): the embeddings prompt answers as its ids do."""
    folder = tiny_hybrid_checkpoints["qwen3_5"]
    llm = LLM(str(folder), **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    from_embeds, from_ids = llm.generate([{"prompt_embeds": _embeds(folder, PROMPTS[1])}, PROMPTS[1]], params)
    assert from_embeds.outputs[0].token_ids == from_ids.outputs[0].token_ids
