"""LLM.beam_search: vLLM's offline beam search call and answer shape (docs/beam_search.md)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence as Seq

from tengyun.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from tengyun.lora.request import LoRARequest
from tengyun.outputs import RequestOutput


class LLMBeamSearchMixin:
    """Mixed into LLM; uses its engine, _add_all and _run."""

    def beam_search(self, prompts: Seq[str | list[int] | dict[str, Any]], params: BeamSearchParams,
                    lora_request: LoRARequest | Seq[LoRARequest | None] | None = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """The params.beam_width best beams of each prompt, best first, in prompt order.

        prompts: {"prompt": str} / {"prompt_token_ids": [...]} as vLLM takes them, or a string or
        a list of token ids. Beams share their prefix's KV blocks in the engine. As vLLM's, each
        beam's ``tokens`` start with the prompt and keep a final EOS, and ``text`` decodes all of
        them. concurrency_limit: at most this many prompts searched at once (None: all).
        """
        from tengyun.entrypoints.llm import _as_lora_list, _as_prompt_list

        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, not {type(params).__name__}.")
        prompt_list = _as_prompt_list(prompts)
        loras = _as_lora_list(lora_request, len(prompt_list))
        engine_params = dataclasses.replace(params, include_stop_str_in_output=True)  # tokens keep the EOS
        if concurrency_limit is not None and concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1, got {concurrency_limit}.")
        step = concurrency_limit or max(1, len(prompt_list))
        outputs: list[BeamSearchOutput] = []
        for start in range(0, len(prompt_list), step):
            batch = list(zip(prompt_list[start:start + step], [engine_params] * step, loras[start:start + step]))
            results = self._run(self._add_all(batch), use_tqdm)
            outputs += [self._beam_search_output(result, lora) for result, (_, _, lora) in zip(results, batch)]
        return outputs

    def _beam_search_output(self, result: RequestOutput, lora: LoRARequest | None) -> BeamSearchOutput:
        tokenizer = self.get_tokenizer()
        sequences = []
        for c in result.outputs:
            tokens = list(result.prompt_token_ids) + list(c.token_ids)
            sequences.append(BeamSearchSequence(
                tokens=tokens, logprobs=c.logprobs or [], lora_request=lora, cum_logprob=c.cumulative_logprob or 0.0,
                text=tokenizer.decode(tokens) if tokenizer is not None else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return BeamSearchOutput(sequences=sequences)
