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
            merged_reference = _reference(model.merge_and_unload(), tokenizer, PROMPTS)  # B A folded into W
    return base, made, base_reference, merged_reference


def _llm(base, **overrides):
    flags = dict(dtype="float32", block_size=8, max_model_len=64, kv_cache_memory="1MiB", enable_lora=True,
                 max_loras=2, max_lora_rank=8)
    return LLM(str(base), **{**flags, **overrides})


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)


def test_each_adapter_and_the_base_match_peft(adapters):
    base, made, base_reference, merged_reference = adapters
    llm = _llm(base)
    for lora, reference in made:
        for output, ref in zip(llm.generate(PROMPTS, PARAMS, lora_request=lora), reference):
            _assert_matches(output, ref)
    for output, ref in zip(llm.generate(PROMPTS, PARAMS), base_reference):
        _assert_matches(output, ref)
    for output, ref in zip(llm.generate(PROMPTS, PARAMS, lora_request=made[0][0]), merged_reference):
        _assert_matches(output, ref)  # PEFT's merged model too


def test_one_batch_mixing_three_adapters_and_the_base_matches_peft(adapters):
    """16 requests in one generate: every prompt on each adapter and on the base, with two slots:
    the scheduler keeps a step to two adapters and the slots turn over."""
    base, made, base_reference, _ = adapters
    llm = _llm(base)
    prompts, loras, references = [], [], []
    for lora, reference in [*made, (None, base_reference)]:
        prompts += PROMPTS
        loras += [lora] * len(PROMPTS)
        references += reference
    for output, ref in zip(llm.generate(prompts, PARAMS, lora_request=loras), references):
        _assert_matches(output, ref)
    assert llm.llm_engine.get_stats().kv_cache_usage == 0.0


def test_under_preemption_and_prefix_caching_each_sequence_keeps_its_adapter(adapters):
    """Every prompt twice on each adapter and the base in 13 blocks of 8 tokens: sequences are
    preempted and recomputed, and prompts shared across adapters never share KV blocks."""
    base, made, base_reference, _ = adapters
    llm = _llm(base, kv_cache_memory=None, num_gpu_blocks_override=13, max_num_batched_tokens=16, max_loras=3)
    prompts, loras, references = [], [], []
    for lora, reference in [*made, (None, base_reference)] * 2:
        prompts += PROMPTS
        loras += [lora] * len(PROMPTS)
        references += reference
    for output, ref in zip(llm.generate(prompts, PARAMS, lora_request=loras), references):
        _assert_matches(output, ref)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.kv_cache_usage == 0.0


LONG_PROMPT = "The quick brown fox jumps over the lazy dog."


def test_long_prompts_on_adapters_beside_short_ones_match_peft(adapters):
    """Prompts of 32+ tokens on an adapter run as segments (plain matmuls into their rows, slice by
    slice) while a short prompt in the same step is grouped by slot; both equal PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tengyun.layers.lora.batch import MIN_SEGMENT_ROWS

    base, made, base_reference, _ = adapters
    tokenizer = AutoTokenizer.from_pretrained(base)
    assert MIN_SEGMENT_ROWS <= len(tokenizer(LONG_PROMPT).input_ids) <= 64 - MAX_TOKENS
    references = []
    for lora, _ in made[:2]:
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                          lora.lora_path).eval()
        references.append(_reference(model, tokenizer, [LONG_PROMPT]))
        with model.disable_adapter():
            base_long = _reference(model, tokenizer, [LONG_PROMPT])
    prompts = [LONG_PROMPT, LONG_PROMPT, PROMPTS[0], LONG_PROMPT]
    loras = [made[0][0], made[1][0], made[0][0], None]
    wanted = [references[0][0], references[1][0], made[0][1][0], base_long[0]]
    for output, ref in zip(_llm(base).generate(prompts, PARAMS, lora_request=loras), wanted):
        _assert_matches(output, ref)


def test_tensor_parallel_2_equals_1(adapters):
    """Real gloo ranks: A and B split as their layers are (each slice's columns per rank); the mixed
    batch, a long prompt's segment among them, gives TP 1's tokens."""
    base, made, base_reference, _ = adapters
    prompts, loras = [*PROMPTS, LONG_PROMPT], [made[0][0], made[1][0], None, made[2][0], made[0][0]]
    tp1 = [o.outputs[0].token_ids for o in _llm(base, max_loras=3).generate(prompts, PARAMS, lora_request=loras)]
    tp2 = _llm(base, max_loras=3, tensor_parallel_size=2)
    assert [o.outputs[0].token_ids for o in tp2.generate(prompts, PARAMS, lora_request=loras)] == tp1
    tp2.llm_engine.shutdown()


def test_requests_naming_an_adapter_are_refused_without_enable_lora_or_with_a_bad_folder(adapters, tmp_path):
    base, made, _, _ = adapters
    with pytest.raises(ValueError, match="LoRA is not enabled: start the engine with --enable-lora"):
        _llm(base, enable_lora=False).generate(PROMPTS[:1], PARAMS, lora_request=made[0][0])
    llm = _llm(base)
    with pytest.raises(ValueError, match="LoRA adapter 'missing'.*no adapter_config.json"):
        llm.generate(PROMPTS[:1], PARAMS, lora_request=LoRARequest("missing", 9, str(tmp_path)))
    assert llm.generate(PROMPTS[:1], PARAMS)[0].outputs[0].token_ids == adapters[2][0][0]  # still serving
