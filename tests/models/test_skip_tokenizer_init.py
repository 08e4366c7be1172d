"""LLM(skip_tokenizer_init=True) (vLLM's --skip-tokenizer-init) over a checkpoint without tokenizer
files: token ids in, HF transformers' greedy token ids out with empty text; what needs text is
refused naming the setting, with nothing queued."""

from __future__ import annotations

import shutil

import pytest
import torch

from tengyun import LLM, SamplingParams

IDS = [5, 17, 33, 99, 120, 7, 8]


@pytest.fixture(scope="module")
def no_tokenizer(tiny_checkpoints, tmp_path_factory):
    folder = tmp_path_factory.mktemp("no_tokenizer") / "model"
    shutil.copytree(tiny_checkpoints["qwen2"], folder, ignore=shutil.ignore_patterns("*token*", "vocab*", "merges*"))
    return folder


@pytest.fixture(scope="module")
def llm(no_tokenizer):
    return LLM(str(no_tokenizer), dtype="float32", max_model_len=64, skip_tokenizer_init=True)


def test_token_ids_in_hf_greedy_token_ids_out_no_text(llm, no_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(no_tokenizer, dtype=torch.float32).eval()
    reference = model.generate(torch.tensor([IDS]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                               pad_token_id=0)[0, len(IDS):].tolist()
    output, = llm.generate({"prompt_token_ids": IDS}, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                                     logprobs=1))
    assert llm.get_tokenizer() is None
    assert output.outputs[0].token_ids == reference
    assert output.outputs[0].text == ""
    assert all(entry[t].decoded_token is None for entry, t in zip(output.outputs[0].logprobs, reference))


@pytest.mark.parametrize("prompt, params, words", [
    ("Hello", SamplingParams(max_tokens=2), "skip_tokenizer_init"),
    (IDS, SamplingParams(max_tokens=2, stop=["."]), "stop strings are only supported when detokenize is True"),
])
def test_what_needs_text_is_refused(llm, prompt, params, words):
    with pytest.raises(ValueError, match=words):
        llm.generate([IDS, prompt], params)
    assert not llm.llm_engine.has_unfinished_requests()


def test_without_the_setting_a_folder_without_tokenizer_is_refused(no_tokenizer):
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        LLM(str(no_tokenizer), dtype="float32", max_model_len=64)
