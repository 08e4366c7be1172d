"""A .gguf's converted folder (cache/converted/...) is an HF folder other tools read:
config.json names `architectures` and the file's head_dim, generation_config.json holds the
bos / eos ids, and tokenizer_config.json names PreTrainedTokenizerFast. transformers'
AutoModelForCausalLM.from_pretrained(folder) loads it, and its logits are Tengyun's on the same
.gguf (prompt logprobs compared position by position) and HF's on the dequantized twin."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("gguf", reason="the gguf package is not installed")
from conftest import make_tiny_checkpoint  # noqa: E402
from gguf_files import write_gguf  # noqa: E402

from tengyun import LLM, SamplingParams  # noqa: E402
from tengyun.models.model_source import converted_dir  # noqa: E402

# attention in Q8_0, the MLP's down projection in Q4_0, the rest F32: a dequantizing conversion
TYPES = {"attn_q.weight": "Q8_0", "attn_k.weight": "Q8_0", "attn_v.weight": "Q8_0", "ffn_down.weight": "Q4_0"}
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [120, 8, 8, 64, 200]]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TENGYUN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "gguf_folder_cache"))


@pytest.fixture(scope="module")
def qwen3_gguf(tiny_tokenizer_dir, tmp_path_factory):
    """(the .gguf, the dequantized HF twin): a dense Qwen3 whose head_dim (32) is not the
    Qwen3Config default (128), so a folder missing the file's key_length would not load."""
    root = tmp_path_factory.mktemp("gguf_folder")
    hf = make_tiny_checkpoint(root / "hf", tiny_tokenizer_dir, "qwen3")
    return write_gguf(hf, root / "tiny-qwen3.gguf", TYPES, twin=root / "twin"), root / "twin"


def _tengyun_prompt_logprobs(gguf_file) -> list[list[float]]:
    """Per prompt: log p(prompt[i] | prompt[:i]) for i >= 1, as Tengyun computes them."""
    llm = LLM(str(gguf_file), kv_cache_memory="8MiB", max_model_len=128, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    try:
        outputs = llm.generate(PROMPTS, params)
    finally:
        llm.llm_engine.shutdown()
    return [[entry[token].logprob for token, entry in zip(prompt[1:], o.prompt_logprobs[1:])]
            for prompt, o in zip(PROMPTS, outputs)]


def _hf_prompt_logprobs(folder) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            logprobs = model(torch.tensor([prompt])).logits[0].log_softmax(-1)  # [len, vocab]
            out.append([float(logprobs[i - 1, prompt[i]]) for i in range(1, len(prompt))])
    return out


def test_converted_folder_names_what_transformers_needs(qwen3_gguf):
    gguf_file, _ = qwen3_gguf
    ours = _tengyun_prompt_logprobs(gguf_file)  # converts the file into the cache
    folder = converted_dir(gguf_file)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 32
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"

    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(folder)("hello world").input_ids == \
        AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)("hello world").input_ids
    hf_folder = _hf_prompt_logprobs(folder)
    hf_twin = _hf_prompt_logprobs(qwen3_gguf[1])
    for theirs, twin, mine in zip(hf_folder, hf_twin, ours):
        torch.testing.assert_close(torch.tensor(theirs), torch.tensor(twin), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(theirs), atol=2e-4, rtol=0)
