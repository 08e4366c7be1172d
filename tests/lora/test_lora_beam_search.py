"""Beam search with a LoRA adapter: every forked beam runs with the request's adapter, so the beams
equal HF generate(num_beams) on PEFT's model with that adapter, and differ from the base model's."""

from __future__ import annotations

import pytest
import torch

from peft_adapters import make_peft_adapter
from tengyun import LLM, BeamSearchParams
from tengyun.lora.request import LoRARequest

PROMPT = [5, 17, 29, 41, 7, 90, 12, 33, 61, 250, 8]
WIDTH, MAX_TOKENS = 3, 8


def test_beams_run_with_the_requests_adapter(tiny_checkpoints, tmp_path):
    base = tiny_checkpoints["qwen2"]
    peft_model = make_peft_adapter(base, tmp_path / "adapter", seed=3, r=4, lora_alpha=8)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=WIDTH,
                                  num_return_sequences=WIDTH, do_sample=False, max_new_tokens=MAX_TOKENS,
                                  early_stopping="never", eos_token_id=None, pad_token_id=0,
                                  output_scores=True, return_dict_in_generate=True)
    reference = [seq[len(PROMPT):].tolist() for seq in out.sequences]
    llm = LLM(str(base), dtype="float32", block_size=8, max_model_len=128, kv_cache_memory="2MiB",
              enable_lora=True, max_lora_rank=8)
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS, ignore_eos=True)
    adapter = LoRARequest("a", 1, str(tmp_path / "adapter"))
    beams = llm.beam_search([PROMPT], params, lora_request=adapter)[0].sequences
    assert [b.tokens[len(PROMPT):] for b in beams] == reference
    assert [b.cum_logprob for b in beams] == pytest.approx([s.item() * MAX_TOKENS for s in out.sequences_scores],
                                                           abs=2e-3)
    assert all(b.lora_request == adapter for b in beams)
    base_beams = llm.beam_search([PROMPT], params)[0].sequences
    assert [b.tokens for b in base_beams] != [b.tokens for b in beams]
