"""The real small models from PyPI: SmolLM2-135M-Instruct (Llama) and Qwen2.5-Coder-0.5B-Instruct
(Qwen2), loaded from their GGUF files, against HF transformers reading the same GGUF."""

from __future__ import annotations

import gc

import pytest
import torch

from tengyun import LLM, SamplingParams
from tengyun.models.model_source import qwen_coder_gguf, smollm2_gguf

pytestmark = pytest.mark.slow

PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "长城是中国古代的",
]
NUM_TOKENS = 32

MODELS = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": smollm2_gguf,
    "Qwen/Qwen2.5-Coder-0.5B-Instruct": qwen_coder_gguf,
}


def _hf_greedy(gguf_path, prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: never stop, never mask EOS
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NUM_TOKENS, pad_token_id=0)
            results.append((ids[0].tolist(), out[0, ids.shape[1]:].tolist()))
    del model
    gc.collect()
    return results


@pytest.mark.parametrize("model", list(MODELS))
def test_real_model_matches_hf_greedy_and_knows_paris(model):
    reference = _hf_greedy(MODELS[model](), PROMPTS)
    llm = LLM(model, max_model_len=512, kv_cache_memory="256MiB")
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    for output, (ref_prompt_ids, ref_tokens) in zip(outputs, reference):
        assert output.prompt_token_ids == ref_prompt_ids
        assert output.outputs[0].token_ids == ref_tokens

    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0]
    assert "Paris" in answer.text
    assert answer.finish_reason == "stop"
