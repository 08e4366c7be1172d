"""ngram speculation on the real small models: the same greedy tokens as without it, on a
code-editing prompt whose answer copies most of the prompt (drafts mostly accepted)."""

from __future__ import annotations

import gc

import pytest
from real_model_limits import REAL_MODEL_LIMITS

from tengyun import LLM, SamplingParams

pytestmark = pytest.mark.slow

CODE = '''def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)
'''
PROMPTS = [
    f"Rename the function mean to average in this code:\n{CODE}\nThe code with the function renamed:\n",
    "The history of the Roman Empire",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@pytest.mark.parametrize("model", ["HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"])
def test_real_model_greedy_tokens_identical_with_ngram_speculation(model):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outputs = {}
    for spec in (None, NGRAM):
        llm = LLM(model, max_model_len=512, kv_cache_memory="256MiB", **REAL_MODEL_LIMITS, dtype="float32",
                  speculative_config=spec)
        outputs[spec is not None] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        stats = llm.llm_engine.scheduler.spec_stats
        del llm
        gc.collect()
    assert outputs[True] == outputs[False]
    assert stats.num_accepted_tokens > 10  # the copy was drafted and accepted
