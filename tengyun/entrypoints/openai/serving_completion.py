"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n + i.

echo puts the prompt before the completion, in the text and (with logprobs) in the logprobs:
the prompt tokens come first, the first one with a null logprob, as OpenAI and vLLM answer.
"""

from __future__ import annotations

import dataclasses
import time
from typing import AsyncIterator, Callable

from tengyun.entrypoints.openai.protocol import (
    MIN_LOGPROB, CompletionLogProbs, CompletionRequest, CompletionResponse, CompletionResponseChoice,
    CompletionStreamResponse, prompt_logprobs_json,
)
from tengyun.entrypoints.openai.completion_embeds import load_prompt_embeds
from tengyun.entrypoints.openai.request_limits import check_sequence_counts
from tengyun.entrypoints.openai.serving_beam_search import beam_search_params, one_event_stream
from tengyun.entrypoints.openai.serving_engine import (
    SSE_DONE, OpenAIServing, StreamedChoice, sampled_then_ranked, sse_error, sse_model, token_text,
)
from tengyun.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """Validates everything before the first engine call: bad input raises RequestError."""
        lora = self.check_model(request.model)
        config = self.engine.config  # embeddings prompts first, as vLLM answers them
        embeds = await load_prompt_embeds(request, config.enable_prompt_embeds, config.model_spec.hidden_size,
                                          self.max_model_len)
        prompts = request.prompts()
        check_sequence_counts(self.limits, request.n, len(embeds) + len(prompts))
        token_lists = embeds + [self.truncate_prompt(await self.tokenize_prompt(p, request.add_special_tokens),
                                                     request.truncate_prompt_tokens) for p in prompts]
        max_tokens = [request.max_tokens if request.max_tokens_set else
                      self.default_max_tokens(len(ids), request.max_tokens) for ids in token_lists]
        for ids, limit in zip(token_lists, max_tokens):
            self.check_length(len(ids), limit)
        if request.use_beam_search:  # serving_beam_search.py
            params = [beam_search_params(request, limit, self.sampling_defaults, self.max_logprobs,
                                         self.engine.config.max_num_seqs) for limit in max_tokens]
        else:
            spec, source = request.structured_outputs_params()
            await self.check_structured_outputs(spec, source)
            params = [request.to_sampling_params(limit, spec, self.sampling_defaults) for limit in max_tokens]
            self.check_against_model(params[0], "logprobs")
        echo_texts = [""] * len(embeds) + [(p if isinstance(p, str) else self.text_of(p)) if request.echo else ""
                                           for p in prompts]
        request_id = self.response_id("cmpl", request)
        # Prompt i's n sequences take turns i * n ... i * n + n - 1 in the round-robin between requests.
        streams = [self.engine.generate(f"{request_id}-{i}", ids, p, first_turn=i * request.n, lora_request=lora)
                   for i, (ids, p) in enumerate(zip(token_lists, params))]
        if request.stream and request.use_beam_search:  # the whole answer in one event, as vLLM
            return one_event_stream(await self._full(request, request_id, streams, echo_texts))
        if request.stream:
            return self._stream(request, request_id, streams, echo_texts)
        return await self._full(request, request_id, streams, echo_texts)

    async def _full(self, request: CompletionRequest, request_id: str, streams,
                    echo_texts: list[str]) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async for i, output in self.merged(streams):
            finals[i] = output
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i in sorted(finals):
            output = finals[i]
            prompt_tokens += len(output.prompt_token_ids)
            prompt_logprobs = prompt_logprobs_json(output.prompt_logprobs)
            for c in output.outputs:
                c = _visible(request, c)
                completion_tokens += len(c.token_ids)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = completion_logprobs(c.token_ids, c.logprobs or [], request.logprobs,
                                                   len(echo_texts[i]), as_ids=self.tokens_as_ids(request))
                    if request.echo:
                        logprobs = self._echo_logprobs(request, output.prompt_token_ids, output.prompt_logprobs,
                                                       logprobs)
                ids = request.return_token_ids
                choices.append(CompletionResponseChoice(
                    index=i * request.n + c.index, text=echo_texts[i] + c.text, logprobs=logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason, prompt_logprobs=prompt_logprobs,
                    token_ids=list(c.token_ids) if ids else None,
                    prompt_token_ids=list(output.prompt_token_ids) if ids else None))
        usage = self.usage(prompt_tokens, completion_tokens, sum(o.num_cached_tokens for o in finals.values()))
        return CompletionResponse(id=request_id, model=self.response_name(request.model), choices=choices,
                                  usage=usage)

    async def _stream(self, request: CompletionRequest, request_id: str, streams,
                      echo_texts: list[str]) -> AsyncIterator[str]:
        """One choice per chunk, as OpenAI and vLLM send them; stream_options as in chat. The
        engine's outputs are DELTA: each carries only what the step added to each sequence."""
        created, n = int(time.time()), request.n
        choices = [StreamedChoice() for _ in range(len(streams) * n)]
        echoed = [False] * len(choices)
        prompt_tokens: dict[int, int] = {}
        cached_tokens: dict[int, int] = {}
        prompt_logprobs: dict[int, PromptLogprobs | None] = {}  # per stream: its first output carries them
        exclude = None if request.include_usage_in_stream else {"usage"}

        def chunk(choice: CompletionResponseChoice | None, completion_tokens: int) -> str:
            usage = None
            if choice is None or request.usage_on_every_chunk:
                usage = self.usage(sum(prompt_tokens.values()), completion_tokens, sum(cached_tokens.values()))
            response = CompletionStreamResponse(id=request_id, created=created, model=self.response_name(request.model),
                                                choices=[choice] if choice else [], usage=usage)
            return sse_model(response, exclude)

        try:
            async for i, output in self.merged(streams):
                prompt_tokens[i], cached_tokens[i] = len(output.prompt_token_ids), output.num_cached_tokens
                prompt_logprobs.setdefault(i, output.prompt_logprobs)
                for c in output.outputs:
                    k = i * n + c.index
                    state = choices[k]
                    if state.done:
                        continue
                    c = _visible(request, c)
                    state.receive(c)
                    choice = self._delta_choice(request, c, state, k, len(echo_texts[i]))
                    if not echoed[k] and request.echo:
                        choice = choice or CompletionResponseChoice(index=k, text="")
                        choice.text = echo_texts[i] + choice.text
                        if request.logprobs is not None:
                            choice.logprobs = self._echo_logprobs(request, output.prompt_token_ids,
                                                                  prompt_logprobs[i], choice.logprobs)
                    echoed[k] = True
                    if choice is not None:
                        state.done = choice.finish_reason is not None
                        if request.return_token_ids and not state.started:
                            choice.prompt_token_ids = list(output.prompt_token_ids)
                        state.started = True
                        yield chunk(choice, sum(ch.num_tokens for ch in choices))
            if request.include_usage_in_stream:
                yield chunk(None, sum(ch.num_sent_tokens for ch in choices))
        except Exception as e:
            yield sse_error(e)
        yield SSE_DONE

    def _echo_logprobs(self, request: CompletionRequest, prompt_token_ids: list[int],
                       prompt_logprobs: PromptLogprobs | None, completion: CompletionLogProbs | None
                       ) -> CompletionLogProbs:
        """The prompt's logprobs (offsets from 0), then the completion's."""
        prompt = completion_logprobs(prompt_token_ids, prompt_logprobs or [], request.logprobs, 0,
                                     decode=lambda token: self.text_of([token]),
                                     as_ids=self.tokens_as_ids(request))
        if completion is not None:
            for name in CompletionLogProbs.model_fields:
                getattr(prompt, name).extend(getattr(completion, name))
        return prompt

    def _delta_choice(self, request: CompletionRequest, c: CompletionOutput, state: StreamedChoice, k: int,
                      echo_len: int = 0) -> CompletionResponseChoice | None:
        """The chunk of choice k for what it received since its last chunk (c: this step's DELTA,
        already in `state`); None when the step made no token, no text and no finish. A step that
        made a token whose text is held back (a stop string's possible start, an incomplete
        character) sends a chunk with empty text, as vLLM's completions do: a client counting
        chunks counts tokens. Text offsets count from the start of the answer, which holds
        ``echo_len`` characters of echoed prompt."""
        if not c.text and not c.token_ids and c.finish_reason is None:
            return None
        new_tokens, new_logprobs = state.take()
        logprobs = None
        if request.logprobs is not None:
            logprobs = completion_logprobs(new_tokens, new_logprobs, request.logprobs,
                                           echo_len + state.num_sent_chars, as_ids=self.tokens_as_ids(request))
        state.num_sent_chars += len(c.text)
        return CompletionResponseChoice(index=k, text=c.text, logprobs=logprobs,
                                        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                        token_ids=new_tokens if request.return_token_ids else None)


def _visible(request: CompletionRequest, c: CompletionOutput) -> CompletionOutput:
    """The completion as answered: nothing of the one token an echo-only request ran for."""
    if not request.echo_only:
        return c
    return dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None)


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob] | None], k: int, offset: int,
                        decode: Callable[[int], str] | None = None, as_ids: bool = False) -> CompletionLogProbs:
    """OpenAI's legacy shape: per token its string, logprob, offset, and {token: logprob} of the
    top-k plus the token itself. An entry None (the first prompt token) has null logprobs and
    its string from ``decode``. Offsets count characters of text even when tokens are named
    "token_id:N" (as_ids)."""
    result = CompletionLogProbs()
    for token_id, entry in zip(token_ids, logprobs):
        if entry is None:
            text = decode(token_id) if decode else ""
            result.tokens.append(token_text(token_id, text, as_ids))
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            result.text_offset.append(offset)
            offset += len(text)
            continue
        sampled = entry[token_id]
        result.tokens.append(token_text(token_id, sampled.decoded_token, as_ids))
        result.token_logprobs.append(max(sampled.logprob, MIN_LOGPROB))
        result.text_offset.append(offset)
        offset += len(sampled.decoded_token or "")
        top = {}  # vLLM's order: the sampled token, then the top k by rank
        for tid, lp in sampled_then_ranked(entry, token_id):
            if tid == token_id or (lp.rank is not None and lp.rank <= k):
                top.setdefault(token_text(tid, lp.decoded_token, as_ids), max(lp.logprob, MIN_LOGPROB))
        result.top_logprobs.append(top)
    return result
