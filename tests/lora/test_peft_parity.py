"""Greedy tokens and logprobs with LoRA adapters equal PEFT's model on the same adapter, for each
adapter alone, for the base model, and for one batch mixing three adapters and the base."""

from __future__ import annotations

import pytest
import torch

from peft_adapters import make_peft_adapter
from tengyun import LLM, SamplingParams
from tengyun.lora.request import LoRARequest

MAX_TOKENS = 8
TOP_K = 3
PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):", "人工智能正在改变世界。"]


def _reference(model, tokenizer, prompts):
    """Per prompt: PEFT's greedy tokens and the top-3 logprobs of each step (full recompute)."""
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt).input_ids
            tokens, tops = [], []
            for _ in range(MAX_TOKENS):
                logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
                top = torch.topk(logprobs, TOP_K)
                tokens.append(int(top.indices[0]))
                tops.append((top.indices.tolist(), top.values.tolist()))
                ids = ids + [tokens[-1]]
            results.append((tokens, tops))
    return results


def _assert_matches(output, reference):
    tokens, tops = reference
    completion = output.outputs[0]
    assert completion.token_ids == tokens
    for step, (ids, values) in enumerate(tops):
        for token, value in zip(ids, values):
            assert completion.logprobs[step][token].logprob == pytest.approx(value, abs=1e-4)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints, tmp_path_factory):
    """Three qwen2 adapters (ranks 4, 8 with rslora, 2 on attention only) and PEFT's answers."""
    from transformers import AutoTokenizer

    base = tiny_checkpoints["qwen2"]
    tokenizer = AutoTokenizer.from_pretrained(base)
    specs = [dict(r=4, lora_alpha=8), dict(r=8, lora_alpha=16, use_rslora=True),
             dict(r=2, lora_alpha=4, targets=["q_proj", "v_proj", "o_proj"])]
    made = []
    for i, spec in enumerate(specs):
        folder = tmp_path_factory.mktemp(f"adapter{i}")
        model = make_peft_adapter(base, folder, seed=i, **spec)
        made.append((LoRARequest(f"adapter{i}", i + 1, str(folder)), _reference(model, tokenizer, PROMPTS)))
        if i == 0:
            with model.disable_adapter():
                base_reference = _reference(model, tokenizer, PROMPTS)
    return base, made, base_reference


def _llm(base, **overrides):
    flags = dict(dtype="float32", block_size=8, max_model_len=64, kv_cache_memory="1MiB", enable_lora=True,
                 max_loras=2, max_lora_rank=8)
    return LLM(str(base), **{**flags, **overrides})


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)


def test_each_adapter_and_the_base_match_peft(adapters):
    base, made, base_reference = adapters
    llm = _llm(base)
    for lora, reference in made:
        for output, ref in zip(llm.generate(PROMPTS, PARAMS, lora_request=lora), reference):
            _assert_matches(output, ref)
    for output, ref in zip(llm.generate(PROMPTS, PARAMS), base_reference):
        _assert_matches(output, ref)


def test_one_batch_mixing_three_adapters_and_the_base_matches_peft(adapters):
    """16 requests in one generate: every prompt on each adapter and on the base, with two slots:
    the scheduler keeps a step to two adapters and the slots turn over."""
    base, made, base_reference = adapters
    llm = _llm(base)
    prompts, loras, references = [], [], []
    for lora, reference in [*made, (None, base_reference)]:
        prompts += PROMPTS
        loras += [lora] * len(PROMPTS)
        references += reference
    for output, ref in zip(llm.generate(prompts, PARAMS, lora_request=loras), references):
        _assert_matches(output, ref)
    assert llm.llm_engine.get_stats().kv_cache_usage == 0.0
