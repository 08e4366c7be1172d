"""The embedded models (SmolLM2-135M-Instruct and Qwen2.5-Coder-0.5B-Instruct, from their PyPI
GGUFs) quantised by `tengyun quantize` to W8A8 and W4A16 still answer the README's question, and
their top-1 token agrees with the fp32 model's along the fp32 model's own greedy continuations of
a fixed prompt set (teacher-forced)."""

from __future__ import annotations

import gc

import pytest
from real_model_limits import REAL_MODEL_LIMITS

from tengyun import LLM, SamplingParams
from tengyun.models.model_source import resolve_model
from tengyun.ops.quantize import quantize_folder

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]  # README.md's
PROMPTS = ["The history of the Roman Empire", "def fibonacci(n):", "Once upon a time, in a small village",
           "The three primary colors are", "Water boils at", "import numpy as np\n\n",
           "The capital of Japan is", "Photosynthesis is the process"]
TOKENS = 24
ENGINE = dict(max_model_len=256, kv_cache_memory="64MiB", **REAL_MODEL_LIMITS)
MODELS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "qwen2.5-coder": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}
GROUP = {"smollm2": 64, "qwen2.5-coder": 128}  # the largest of 128 / 64 dividing every layer's inputs
# Stated floors under the figures measured (printed by the test), of 192 positions:
# SmolLM2 (2026-12-01): W8A8 in float32 0.885 (0.849 in bfloat16), W4A16 group 64 in bfloat16 0.562
# (0.599 in float32, the exact reference: round-to-nearest int4 costs this much on a 135M model);
# bf16 dense 0.958. Qwen2.5-Coder (2026-12-02): W8A8 in float32 0.953, W4A16 group 128 in bfloat16 0.833;
# with the LM head quantised too (2026-12-03): W8A8 0.953, W4A16 + W8A16 head 0.833 (the same);
# SmolLM2 with its tied head untied and quantised (2026-12-03): W8A8 0.875, W4A16 + W8A16 head 0.573.
MIN_TOP1_AGREEMENT = {("smollm2", "w8a8"): 0.8, ("smollm2", "w4a16"): 0.5,
                      ("smollm2", "w8a8-lmhead"): 0.8, ("smollm2", "w4a16-lmhead"): 0.5,
                      ("qwen2.5-coder", "w8a8"): 0.9, ("qwen2.5-coder", "w4a16"): 0.75,
                      ("qwen2.5-coder", "w8a8-lmhead"): 0.9, ("qwen2.5-coder", "w4a16-lmhead"): 0.75}
HEAD = "-lmhead"  # `tengyun quantize --quantize-lm-head` (SmolLM2's tied head is untied)


@pytest.fixture(scope="module", params=list(MODELS))
def fp32_run(request) -> tuple[str, list[list[int]]]:
    """(model, prompt + fp32 greedy continuation token ids per prompt)."""
    llm = LLM(MODELS[request.param], dtype="float32", **ENGINE)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True))
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    return request.param, [o.prompt_token_ids + list(o.outputs[0].token_ids) for o in outputs]


def _top1_agreement(llm: LLM, sequences: list[list[int]]) -> float:
    """Fraction of continuation positions where ``llm``'s most likely token is the fp32 one."""
    outputs = llm.generate(sequences, SamplingParams(max_tokens=1, prompt_logprobs=1))
    hits = [entry[token].rank == 1 for o, seq in zip(outputs, sequences)
            for entry, token in zip(o.prompt_logprobs[len(seq) - TOKENS:], seq[len(seq) - TOKENS:])]
    return sum(hits) / len(hits)


@pytest.mark.parametrize("scheme, dtype", [("w8a8", "float32"), ("w4a16", "bfloat16"),
                                           ("w8a8-lmhead", "float32"), ("w4a16-lmhead", "bfloat16")])
def test_quantized_model_answers_and_agrees_with_fp32(tmp_path, fp32_run, scheme, dtype):
    model, continuations = fp32_run
    source = resolve_model(MODELS[model], "auto").folder
    folder = quantize_folder(source, tmp_path / scheme, scheme.removesuffix(HEAD), group_size=GROUP[model],
                             head=scheme.endswith(HEAD)).out_dir
    llm = LLM(str(folder), dtype=dtype, **ENGINE)
    try:
        answer = llm.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0]
        agreement = _top1_agreement(llm, continuations)
    finally:
        llm.llm_engine.shutdown()
    print(f"{model} {scheme} ({dtype}): {answer.text!r}; top-1 agreement with fp32 {agreement:.3f}")
    assert "Paris" in answer.text
    assert agreement >= MIN_TOP1_AGREEMENT[model, scheme]
