"""Greedy tokens and top-5 logprobs equal HF transformers' under chunked prefill, preemption
and prefix caching, on tiny random Llama / Qwen2 / Qwen3 checkpoints (fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from tengyun import LLM, SamplingParams

MAX_TOKENS = 12
TOP_K = 5


def _prompts(vocab: int) -> list[list[int]]:
    """10 prompts: lengths 3..90, four sharing a 40-token prefix, two longer than the 32-token budget."""
    rng = random.Random(0)
    shared = [rng.randrange(1, vocab) for _ in range(40)]
    lengths = [3, 9, 17, 25, 33, 50, 70, 90]
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]
    prompts += [shared + [rng.randrange(1, vocab) for _ in range(n)] for n in (5, 13, 21, 30)]
    return prompts


def _hf_reference(folder, prompts, max_tokens=MAX_TOKENS):
    """Per prompt: greedy tokens and per-step top-5 (ids, logprobs), full recompute each step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    results = []
    for prompt in prompts:
        ids = list(prompt)
        tokens, tops = [], []
        with torch.no_grad():
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                logprobs = torch.log_softmax(logits, dim=-1)
                top = torch.topk(logprobs, TOP_K)
                tokens.append(int(logits.argmax()))
                tops.append((top.indices.tolist(), top.values.tolist()))
                ids.append(tokens[-1])
        results.append((tokens, tops))
    return results


_reference_cache: dict = {}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix", "noprefix"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "unchunked"])
def test_greedy_matches_hf_under_pressure(tiny_checkpoints, arch, prefix_caching, chunked):
    folder = tiny_checkpoints[arch]
    prompts = _prompts(300)
    if arch not in _reference_cache:
        _reference_cache[arch] = _hf_reference(folder, prompts)
    reference = _reference_cache[arch]

    llm = LLM(
        str(folder), dtype="float32", block_size=8, max_model_len=104,
        num_gpu_blocks_override=13,  # 104 slots for ~660 tokens of demand: preemption must happen
        max_num_batched_tokens=32 if chunked else 104, max_num_seqs=16,
        enable_prefix_caching=prefix_caching, enable_chunked_prefill=chunked,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    outputs = llm.generate(prompts, params)

    for output, (ref_tokens, ref_tops) in zip(outputs, reference):
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens
        assert completion.finish_reason == "length"
        for step, (ref_ids, ref_values) in enumerate(ref_tops):
            entry = completion.logprobs[step]
            for token, value in zip(ref_ids, ref_values):
                assert entry[token].logprob == pytest.approx(value, abs=1e-4)
            assert entry[completion.token_ids[step]].rank == 1

    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache_usage == 0.0  # every block released
    if prefix_caching:
        assert stats.prefix_cache_hits > 0
    else:
        assert stats.prefix_cache_hits == 0


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32, "rope_theta": 500000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
], ids=lambda r: r["rope_type"])
def test_rope_scaling_types_match_hf(tmp_path, tiny_tokenizer_dir, rope):
    from conftest import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path, tiny_tokenizer_dir, "llama", rope_parameters=rope)
    prompts = _prompts(300)[5:8]  # 50-90 tokens: past original_max_position_embeddings
    reference = _hf_reference(folder, prompts)
    llm = LLM(str(folder), dtype="float32", block_size=8, max_model_len=128, kv_cache_memory="1MiB")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    for output, (ref_tokens, ref_tops) in zip(llm.generate(prompts, params), reference):
        assert output.outputs[0].token_ids == ref_tokens
        for step, (ref_ids, ref_values) in enumerate(ref_tops):
            for token, value in zip(ref_ids, ref_values):
                assert output.outputs[0].logprobs[step][token].logprob == pytest.approx(value, abs=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_single_sequence_decode_of_64_tokens_matches_hf(tiny_checkpoints, arch):
    folder = tiny_checkpoints[arch]
    prompt = _prompts(300)[1]
    reference = _hf_reference(folder, [prompt], max_tokens=64)[0]
    llm = LLM(str(folder), dtype="float32", block_size=8, max_model_len=128, kv_cache_memory="1MiB")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=TOP_K))[0]
    assert out.outputs[0].token_ids == reference[0]
    for step, (ref_ids, ref_values) in enumerate(reference[1]):
        for token, value in zip(ref_ids, ref_values):
            assert out.outputs[0].logprobs[step][token].logprob == pytest.approx(value, abs=1e-4)
