"""LLM.beam_search on SmolLM2-135M-Instruct (its GGUF from PyPI) against HF transformers'
generate(num_beams) reading the same GGUF, in the settings where HF and vLLM's beam search agree
(docs/beam_search.md says where they part)."""

from __future__ import annotations

import gc

import pytest
import torch

from hf_reference import hf_from_gguf
from real_model_limits import REAL_MODEL_LIMITS

from tengyun import LLM, BeamSearchParams
from tengyun.models.model_source import smollm2_gguf

pytestmark = pytest.mark.slow

WIDTH, MAX_TOKENS = 3, 24


def hf_beams(prompt_text: str):
    """(prompt ids, {(length_penalty, eos on): [(tokens up to the first EOS, cumulative logprob)]})."""
    tokenizer, model = hf_from_gguf(smollm2_gguf(), dtype=torch.float32)
    eos = tokenizer.eos_token_id
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt_text}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    beams = {}
    for length_penalty, eos_on in ((1.0, True), (0.0, False)):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=WIDTH, num_return_sequences=WIDTH,
                                 do_sample=False, max_new_tokens=MAX_TOKENS, length_penalty=length_penalty,
                                 early_stopping="never", eos_token_id=eos if eos_on else None, pad_token_id=eos,
                                 output_scores=True, return_dict_in_generate=True)
        found = []
        for seq, score in zip(out.sequences, out.sequences_scores):
            tokens = seq[ids.shape[1]:].tolist()
            if eos_on and eos in tokens:
                tokens = tokens[:tokens.index(eos) + 1]
            found.append((tokens, score.item() * len(tokens) ** length_penalty))  # HF divides by generated length
        beams[length_penalty, eos_on] = found
    del model
    gc.collect()
    return ids[0].tolist(), eos, beams


def test_smollm2_beams_match_hf():
    prompt, eos, reference = hf_beams("What is the capital of France?")
    llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct", dtype="float32", max_model_len=512, kv_cache_memory="256MiB",
              **REAL_MODEL_LIMITS)
    # EOS on, length_penalty 1: the best beam ends with EOS in both ("The capital of France is Paris."),
    # scored alike; lower beams may differ (HF divides by the generated length, vLLM by the whole).
    best = llm.beam_search([{"prompt_token_ids": prompt}],
                           BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS))[0].sequences[0]
    tokens, cum = reference[1.0, True][0]
    assert best.tokens[len(prompt):] == tokens and tokens[-1] == eos and best.finish_reason == "stop"
    assert best.cum_logprob == pytest.approx(cum, abs=1e-3)
    assert "Paris" in best.text
    # EOS off, length_penalty 0: every beam and score the same
    beams = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(
        beam_width=WIDTH, max_tokens=MAX_TOKENS, ignore_eos=True, length_penalty=0.0))[0].sequences
    assert [b.tokens[len(prompt):] for b in beams] == [t for t, _ in reference[0.0, False]]
    assert [b.cum_logprob for b in beams] == pytest.approx([c for _, c in reference[0.0, False]], abs=1e-3)
