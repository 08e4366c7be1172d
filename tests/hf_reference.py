"""HF transformers as the reference: greedy continuations with the logprob HF gives each token."""

from __future__ import annotations

from pathlib import Path

import torch

from tengyun.models.gguf_reader import shared_readers


def hf_from_gguf(gguf_file: Path, **model_kwargs):
    """(tokenizer, model in eval mode) as transformers loads them from a .gguf. transformers parses
    the header in each of its loaders (config, tokenizer, tensors): ~7 s a parse for Qwen2.5-Coder's;
    shared_readers() has them share one parse (the same gguf-py reader, the same file)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with shared_readers():
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, **model_kwargs)
    return tokenizer, model.eval()


def hf_greedy_with_logprobs(model, tokenizer, prompts: list[str],
                            max_new_tokens: int) -> list[tuple[list[int], list[int], list[float]]]:
    """Per prompt: (prompt ids, HF's greedy tokens, HF's logprob of each, from float32 scores).
    ``model`` generates to exactly ``max_new_tokens`` (its eos is switched off here)."""
    model.generation_config.eos_token_id = None
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0, output_scores=True,
                                 return_dict_in_generate=True)
            tokens = out.sequences[0, ids.shape[1]:].tolist()
            logprobs = [torch.log_softmax(scores[0].float(), dim=-1)[t].item() for scores, t in zip(out.scores, tokens)]
            results.append((ids[0].tolist(), tokens, logprobs))
    return results
