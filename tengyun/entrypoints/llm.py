"""The offline API, shaped like vLLM's so a user can swap imports:

    from tengyun import LLM, SamplingParams
    llm = LLM(model="/path/to/Qwen2.5-0.5B-Instruct", max_model_len=4096)
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, max_tokens=32))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
from typing import Any, Sequence as Seq

from tengyun.config import EngineConfig
from tengyun.engine.llm_engine import LLMEngine
from tengyun.entrypoints.llm_beam_search import LLMBeamSearchMixin
from tengyun.entrypoints.llm_pooling import LLMPoolingMixin
from tengyun.generation_config import sampling_defaults
from tengyun.lora.request import LoRARequest
from tengyun.outputs import RequestOutput
from tengyun.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM(LLMPoolingMixin, LLMBeamSearchMixin):  # embed() ...: llm_pooling.py; beam_search(): llm_beam_search.py
    def __init__(self, model: str | None = None, **engine_args: Any):
        self._start(EngineConfig(model=model, **engine_args))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        _check_not_bootstrapping()
        if config.data_parallel_size > 1:
            raise ValueError(f"LLM(data_parallel_size={config.data_parallel_size}) runs one engine in this process; "
                             f"data-parallel replicas are served by `tengyun serve --data-parallel-size "
                             f"{config.data_parallel_size}`: use data_parallel_size=1 here, or one LLM per process.")
        self._sampling_defaults = sampling_defaults(config.finalize())  # a bad file fails before the weights load
        self.llm_engine = LLMEngine.from_config(config)
        self._request_ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with --generation-config's defaults (the model's generation_config.json
        unless generation_config="vllm"); what generate() and chat() use without sampling_params."""
        return SamplingParams(**self._sampling_defaults)

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        prompts: a string, a list of token ids, {"prompt": str} / {"prompt_token_ids": [...]} /
        {"prompt_embeds": tensor [seq_len, hidden_size]} (LLM(enable_prompt_embeds=True);
        docs/prompt_embeds.md), or a list of those. sampling_params: one for all, one per prompt, or None for
        get_default_sampling_params(). lora_request: the adapter for all, one per prompt (None: the
        base model), or None; needs LLM(enable_lora=True) (docs/lora.md).
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _as_params_list(sampling_params, len(prompt_list))
        loras = _as_lora_list(lora_request, len(prompt_list))
        return self._run(self._add_all(zip(prompt_list, params_list, loras)), use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template, **(chat_template_kwargs or {}),
            )
            # The template already holds BOS and friends: do not add special tokens twice.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        outputs = self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)
        for output, prompt in zip(outputs, prompts):
            output.prompt = prompt["prompt"]
        return outputs

    def _add_all(self, requests) -> list[str]:
        """Queue each (prompt, params, LoRA request or None); the ids. All or none: when one is
        refused (ValueError), those already queued are aborted and drained before it is raised."""
        request_ids = []
        try:
            for prompt, params, lora in requests:
                request_id = str(next(self._request_ids))
                self.llm_engine.add_request(request_id, _prompt_value(prompt), params, lora_request=lora)
                request_ids.append(request_id)
        except ValueError:
            self.llm_engine.abort_request(request_ids)
            self._drain(set(request_ids))
            raise
        return request_ids

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(request_ids), desc="Processed prompts")
        while len(finished) < len(wanted):
            for output in self.llm_engine.step():
                if output.finished and output.request_id in wanted:
                    finished[output.request_id] = output
                    if progress:
                        progress.update(1)
        if progress:
            progress.close()
        return [finished[r] for r in request_ids]

    def _drain(self, request_ids: set[str]) -> None:
        """Collect the abort outputs of requests we gave up on, so they do not leak."""
        while request_ids and self.llm_engine.has_unfinished_requests():
            for output in self.llm_engine.step():
                request_ids.discard(output.request_id)


def _check_not_bootstrapping() -> None:
    """Refuse to build an LLM while multiprocessing starts this process: its "spawn" and
    "forkserver" re-run the main script's top level in each child they start (the user's own
    Pool or Process; forkserver is Python 3.14's default), and each would load the model again.
    Tengyun's own ranks never re-run the script (executor/rank_process.py)."""
    # multiprocessing's own "bootstrapping phase" flag (spawn._main, forkserver), which its
    # _check_not_importing_main reads; True only while the child imports the main module.
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            "LLM(...) was called while multiprocessing was starting this process: its spawn and "
            "forkserver methods re-run your script's top level in every child process they start, "
            "and each would load the model again. Put the code that builds the LLM under "
            "`if __name__ == \"__main__\":` (or start your own processes with fork)."
        )


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]
    return prompts


def _as_params_list(params, count: int) -> list[SamplingParams]:
    """One per prompt, each a FINAL_ONLY copy: generate() returns finished outputs only, so the
    engine need not build one per step (the caller's objects stay as they were)."""
    if isinstance(params, SamplingParams):
        return [_final_only(params)] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"sampling_params has {len(params)} entries but there are {count} prompts.")
    return [_final_only(p) for p in params]


def _as_lora_list(lora_request, count: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"lora_request has {len(loras)} entries but there are {count} prompts.")
    return loras


def _final_only(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


def _prompt_value(prompt: PromptType) -> Any:
    """A string, token ids, or (vLLM's EmbedsPrompt {"prompt_embeds": tensor}) a PromptEmbeds."""
    if isinstance(prompt, dict):
        if "prompt_embeds" in prompt:
            from tengyun.prompt_embeds_codec import from_tensor

            return from_tensor(prompt["prompt_embeds"])
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return prompt["prompt"]
    return prompt
