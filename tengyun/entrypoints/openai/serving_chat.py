"""POST /v1/chat/completions: the chat template renders the messages (and tools), then one engine
request; the answer's text is split into reasoning, content and tool calls by the configured parsers.

tool_choice:
    "none"                 tools reach the template, nothing is parsed
    "auto"                 --enable-auto-tool-choice: the --tool-call-parser reads the model's calls
    "required"             as vLLM: a JSON schema makes the whole output an array of calls
                           ([{"name": ..., "parameters": {...}}], one item without
                           parallel_tool_calls), whatever --tool-call-parser says; finish "tool_calls"
    named                  as vLLM: the function's parameters schema constrains the whole output,
                           which is that call's arguments JSON; the server builds the call from it;
                           finish "stop" (OpenAI's answer to a named call)
"""

from __future__ import annotations

import time
from typing import AsyncIterator

from tengyun.entrypoints.openai.chat_output import ChoiceOutputParser, ParsedOutput
from tengyun.entrypoints.openai.protocol import (
    MIN_LOGPROB, ChatCompletionLogProb, ChatCompletionLogProbs, ChatCompletionLogProbsContent, ChatCompletionRequest,
    ChatCompletionResponse, ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse, ChatResponseMessage, DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall,
    NamedToolChoice, RequestError, ToolCall, UsageInfo, prompt_logprobs_json,
)
from tengyun.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from tengyun.entrypoints.openai.request_limits import check_sequence_counts
from tengyun.entrypoints.openai.serving_beam_search import beam_search_params
from tengyun.entrypoints.openai.serving_engine import (
    SSE_DONE, OpenAIServing, StreamedChoice, sampled_then_ranked, sse_error, sse_model, token_text,
)
from tengyun.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from tengyun.entrypoints.openai.tool_parsers.named_call import NamedCallParser
from tengyun.entrypoints.openai.tool_parsers.required_calls import RequiredCallsParser, required_calls_schema
from tengyun.outputs import CompletionOutput, RequestOutput
from tengyun.sampling_params import StructuredOutputsParams
from tengyun.structured_output import after_reasoning


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_parser_cls = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.reasoning_parser_cls = get_reasoning_parser(reasoning_parser) if reasoning_parser else None

    async def create_chat_completion(
            self, request: ChatCompletionRequest, as_sse: bool = True,
    ) -> ChatCompletionResponse | AsyncIterator[str] | AsyncIterator[ChatCompletionStreamResponse]:
        """Validates everything before the first engine call: bad input raises RequestError.
        A stream is SSE text, or (as_sse False: the Responses API) the chunk objects themselves,
        an engine error raised from the iterator rather than sent as an error event."""
        lora = self.check_model(request.model)
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        check_sequence_counts(self.limits, request.n, 1)
        text = await self.render_chat(request.messages, request.add_generation_prompt,
                                      request.continue_final_message, request.chat_template,
                                      request.chat_template_kwargs, tools)
        # The template already holds BOS and friends: special tokens only when asked (vLLM's default: no).
        token_ids = self.truncate_prompt(await self.worker.encode(text, request.add_special_tokens),
                                         request.truncate_prompt_tokens)
        max_tokens = request.requested_max_tokens
        if max_tokens is None:
            max_tokens = self.default_max_tokens(len(token_ids), None)
        self.check_length(len(token_ids), max_tokens, "messages")
        tool_parser, spec, source = self._tool_parser_and_constraint(request, tools)
        await self.check_structured_outputs(spec, source)
        reasoning = self.reasoning_parser_cls() if self.reasoning_parser_cls else None
        in_reasoning = reasoning is not None and reasoning.prompt_opens_reasoning(text)
        if spec is not None and in_reasoning:  # constrain the answer, not the thoughts
            spec = after_reasoning(spec, reasoning.end)
            await self.check_structured_outputs(spec, source)
        if request.use_beam_search:  # serving_beam_search.py; tool_choice required / named constrain
            if spec is not None:
                raise RequestError(f"{source} constrains the output, which beam search does not do: drop "
                                   f"use_beam_search or {source}.", source)
            params = beam_search_params(request, max_tokens, self.sampling_defaults, self.max_logprobs,
                                        self.engine.config.max_num_seqs)
        else:
            params = request.to_sampling_params(max_tokens, spec, self.sampling_defaults)
            self.check_against_model(params, "top_logprobs")
        parsers = [ChoiceOutputParser(reasoning, tool_parser, in_reasoning) for _ in range(request.n)]
        request_id = self.response_id("chatcmpl", request)
        stream = self.engine.generate(request_id, token_ids, params, lora_request=lora)
        if request.stream:
            chunks = self._stream_chunks(request, request_id, stream, parsers)
            return self._sse(request, chunks) if as_sse else chunks
        return await self._full(request, request_id, stream, parsers)

    def _tool_parser_and_constraint(self, request: ChatCompletionRequest, tools: list[dict] | None
                                    ) -> tuple[ToolParser | None, StructuredOutputsParams | None, str | None]:
        """(the parser that reads this answer's tool calls, the output constraint, its field)."""
        spec, source = request.structured_outputs_params()
        choice = request.tool_choice
        if choice is None:
            choice = "auto" if tools and self.enable_auto_tool_choice else "none"
        if not tools or choice == "none":
            return None, spec, source
        if choice == "auto":
            if not (self.enable_auto_tool_choice and self.tool_parser_cls):
                raise RequestError('"auto" tool choice needs the server started with --enable-auto-tool-choice '
                                   "--tool-call-parser NAME (hermes or qwen3_coder).", "tool_choice")
            return self.tool_parser_cls(tools), spec, source
        if spec is not None:
            raise RequestError(f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} "
                               f"already constrains the output: drop {source}.", source)
        functions = [t["function"] for t in tools]
        if isinstance(choice, NamedToolChoice):  # only the arguments are generated (vLLM's way)
            function = next(f for f in functions if f["name"] == choice.function.name)
            schema = function.get("parameters") or {"type": "object", "properties": {}}
            return NamedCallParser(function["name"]), StructuredOutputsParams(json=schema), "tools"
        try:
            schema = required_calls_schema(functions, request.parallel_tool_calls)
        except ValueError as e:
            raise RequestError(str(e), "tools") from None
        return RequiredCallsParser(tools), StructuredOutputsParams(json=schema), "tools"

    async def _full(self, request: ChatCompletionRequest, request_id: str, stream,
                    parsers: list[ChoiceOutputParser]) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        async for _, output in self.merged([stream]):
            final = output
        choices = []
        for c in final.outputs:
            logprobs = None
            if request.logprobs:
                logprobs = chat_logprobs(c.token_ids, c.logprobs or [], request.top_logprobs or 0,
                                         self.tokens_as_ids(request))
            parsed = parsers[c.index].parse(c.text)
            message = _message(parsed, request.include_reasoning, forced_calls=request.tool_choice_forces_calls)
            if request.echo_text and message.content is not None:
                message.content = request.echo_text + message.content
            choices.append(ChatCompletionResponseChoice(
                index=c.index, message=message, logprobs=logprobs,
                finish_reason=_finish_reason(c.finish_reason, bool(parsed.tool_calls), request),
                stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if request.return_token_ids else None))
        usage = self.usage(len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs),
                           final.num_cached_tokens)
        return ChatCompletionResponse(id=request_id, model=self.response_name(request.model), choices=choices,
                                      usage=usage,
                                      prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs),
                                      prompt_token_ids=(list(final.prompt_token_ids) if request.return_token_ids
                                                        else None))

    async def _sse(self, request: ChatCompletionRequest,
                   chunks: AsyncIterator[ChatCompletionStreamResponse]) -> AsyncIterator[str]:
        exclude = None if request.include_usage_in_stream else {"usage"}
        try:
            async for response in chunks:
                yield sse_model(response, exclude)
        except Exception as e:
            yield sse_error(e)
        finally:
            await chunks.aclose()  # a client that left: its engine request is aborted now
        yield SSE_DONE

    async def _stream_chunks(self, request: ChatCompletionRequest, request_id: str, stream,
                             parsers: list[ChoiceOutputParser]) -> AsyncIterator[ChatCompletionStreamResponse]:
        """One choice per chunk, as OpenAI and vLLM send them. A choice's role chunk goes out with
        the request's first output, not before prefill: a client's first chunk times the first
        token. stream_options: include_usage adds a last chunk with usage; continuous_usage_stats
        puts the usage so far on every chunk too. The engine's outputs are DELTA: each carries only
        what the step added, so no step reads the answer so far (the parsers, when set, do)."""
        created, n = int(time.time()), request.n
        choices, num_calls = [StreamedChoice() for _ in range(n)], [0] * n
        usage, cached = UsageInfo(), 0  # so far; replaced at every engine output

        def chunk(choice: ChatCompletionResponseStreamChoice | None,
                  prompt_ids: list[int] | None = None) -> ChatCompletionStreamResponse:
            on_chunk = choice is None or request.usage_on_every_chunk
            return ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.response_name(request.model),
                choices=[choice] if choice else [],
                usage=usage if on_chunk else None, prompt_token_ids=prompt_ids)

        async for _, output in self.merged([stream]):
            cached = output.num_cached_tokens
            for c in output.outputs:
                choices[c.index].receive(c)
            so_far = self.usage(len(output.prompt_token_ids), sum(ch.num_tokens for ch in choices), cached)
            for c in output.outputs:
                state = choices[c.index]
                if state.done:
                    continue
                if not state.started:
                    first = not any(ch.started for ch in choices)
                    state.started = True
                    if first:  # as vLLM: the role chunk counts the prompt, no completion tokens yet
                        usage = self.usage(len(output.prompt_token_ids), 0, cached)
                    yield chunk(ChatCompletionResponseStreamChoice(
                        index=c.index, delta=DeltaMessage(role="assistant", content=request.echo_text)),
                        list(output.prompt_token_ids) if first and request.return_token_ids else None)
                usage = so_far
                choice = self._stream_choice(request, c, state, parsers[c.index], num_calls)
                if choice is not None:
                    state.done = choice.finish_reason is not None
                    yield chunk(choice)
        if request.include_usage_in_stream:
            usage = self.usage(usage.prompt_tokens, sum(ch.num_sent_tokens for ch in choices), cached)
            yield chunk(None)

    def _stream_choice(self, request: ChatCompletionRequest, c: CompletionOutput, state: StreamedChoice,
                       parser: ChoiceOutputParser, num_calls: list[int]) -> ChatCompletionResponseStreamChoice | None:
        """The chunk of choice c for what it received since its last chunk (c: this step's DELTA,
        already in `state`); None while there is nothing to send."""
        parsed = parser.add(c.text, finished=c.finish_reason is not None)
        delta = _delta(parsed, num_calls[c.index], request.include_reasoning)
        num_calls[c.index] += len(parsed.tool_calls)
        if delta is None and c.finish_reason is None and not (request.logprobs and state.has_unsent_tokens):
            return None
        new_tokens, new_logprobs = state.take()
        logprobs = None
        if request.logprobs:
            logprobs = chat_logprobs(new_tokens, new_logprobs, request.top_logprobs or 0, self.tokens_as_ids(request))
        return ChatCompletionResponseStreamChoice(
            index=c.index, delta=delta or DeltaMessage(), logprobs=logprobs,
            finish_reason=_finish_reason(c.finish_reason, num_calls[c.index] > 0, request), stop_reason=c.stop_reason,
            token_ids=new_tokens if request.return_token_ids else None)


def _message(parsed: ParsedOutput, include_reasoning: bool, forced_calls: bool = False) -> ChatResponseMessage:
    """Content is None only beside tool calls the model chose to make (as OpenAI); beside calls a
    required / named tool_choice forced, "" (as vLLM); otherwise a string, maybe empty."""
    reasoning = parsed.reasoning if include_reasoning else None
    content = parsed.content if parsed.content or not parsed.tool_calls or forced_calls else None
    calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed.tool_calls]
    return ChatResponseMessage(content=content, reasoning_content=reasoning, reasoning=reasoning, tool_calls=calls)


def _delta(parsed: ParsedOutput, first_index: int, include_reasoning: bool) -> DeltaMessage | None:
    """One stream delta; a tool call travels whole, with its id, name and arguments."""
    reasoning = parsed.reasoning if include_reasoning else None
    calls = [DeltaToolCall(index=first_index + k, id=c.id, type="function",
                           function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
             for k, c in enumerate(parsed.tool_calls)]
    if not (reasoning or parsed.content or calls):
        return None
    return DeltaMessage(content=parsed.content or None, reasoning_content=reasoning, reasoning=reasoning,
                        tool_calls=calls or None)


def _finish_reason(reason: str | None, called: bool, request: ChatCompletionRequest) -> str | None:
    """"tool_calls" for calls the model made (auto) or was made to make (required); a call to a
    named function ends "stop", as OpenAI and vLLM answer it."""
    named = isinstance(request.tool_choice, NamedToolChoice)
    return "tool_calls" if reason == "stop" and called and not named else reason


def chat_logprobs(token_ids: list[int], logprobs: list[dict], k: int, as_ids: bool = False) -> ChatCompletionLogProbs:
    """Per sampled token: its logprob and k top_logprobs (k -1: every token) in vLLM's order and
    choice: the sampled token first, then the most likely others by rank."""
    def entry_of(token_id: int, lp, cls=ChatCompletionLogProb):
        text = token_text(token_id, lp.decoded_token, as_ids)
        return cls(token=text, logprob=max(lp.logprob, MIN_LOGPROB), bytes=list(text.encode("utf-8")))

    content = []
    for token_id, entry in zip(token_ids, logprobs):
        most = len(entry) if k == -1 else k
        sampled = entry_of(token_id, entry[token_id], ChatCompletionLogProbsContent)
        sampled.top_logprobs = [entry_of(tid, lp) for tid, lp in sampled_then_ranked(entry, token_id)[:most]]
        content.append(sampled)
    return ChatCompletionLogProbs(content=content)
