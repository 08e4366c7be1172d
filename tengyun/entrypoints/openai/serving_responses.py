"""POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel: the Responses
API on the chat path. A request becomes chat messages (responses_input.py) and a chat request
(tools nested under "function", text.format as response_format, max_output_tokens as
max_completion_tokens), served by OpenAIServingChat: the same template, parsers, structured
output and engine request as /v1/chat/completions; the answer's reasoning, text and tool calls
become output items.

    store (default on, responses_store.py)  the response and its conversation are kept:
                                            GET by id, previous_response_id continues it
    background                              answered "queued" at once, run as a task, "queued"
                                            until it ends (vLLM's); cancel stops it ("cancelled");
                                            with stream, its events are logged for readers
                                            (responses_event_log.py)
    stream                                  typed events (responses_stream.py)
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

from pydantic import ValidationError

from tengyun.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionResponse
from tengyun.entrypoints.openai.request_model import RequestError
from tengyun.entrypoints.openai.responses_event_log import EventLog
from tengyun.entrypoints.openai.responses_input import chat_messages
from tengyun.entrypoints.openai.responses_protocol import (
    InputTokensDetails, OutputTokensDetails, ResponsesRequest, ResponsesResponse, ResponseUsage, item_id,
)
from tengyun.entrypoints.openai.responses_store import ResponsesStore, StoredResponse
from tengyun.entrypoints.openai.responses_stream import ResponseEventStream, output_items, token_logprobs
from tengyun.entrypoints.openai.serving_chat import OpenAIServingChat
from tengyun.entrypoints.openai.serving_engine import error_status, public_message

logger = logging.getLogger("tengyun.server")
# chat's field -> the Responses field a client sent, for the 400s the chat path raises
FIELD_NAMES = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens", "messages": "input",
               "response_format": "text.format"}


class OpenAIServingResponses:
    def __init__(self, chat: Callable[[], OpenAIServingChat], store: ResponsesStore):
        self._chat = chat  # the server's chat handler, made once the engine is up
        self.store = store

    async def create(self, request: ResponsesRequest) -> ResponsesResponse | AsyncIterator[str]:
        """Bad input raises RequestError before the engine sees the request."""
        chat = self._chat()
        chat.check_model(request.model)
        store = request.store and self.store.enabled  # off: ignored, as vLLM ignores it
        if request.background and not self.store.enabled:
            raise RequestError("background needs the response store, which VLLM_ENABLE_RESPONSES_API_STORE=0 "
                               "turned off.", "background")
        previous = None
        if request.previous_response_id is not None:
            previous = self.get(request.previous_response_id, "previous_response_id")
        messages = chat_messages(request, previous.messages if previous else None,
                                 previous.response.output if previous else None)
        chat_request = _chat_request(request, messages)
        response_id = f"resp_{request.request_id}" if request.request_id else item_id("resp")
        base = ResponsesResponse.of_request(request, response_id, chat.response_name(request.model),
                                            "in_progress", store=store)
        if request.background and request.stream:
            return self._background_stream(chat, chat_request, base, messages)
        if request.background:
            return await self._background(chat, chat_request, base, messages)
        if request.stream:
            keep = (lambda response: self.store.put(StoredResponse(response, messages))) if store else None
            return await self._stream(chat, chat_request, base, keep)
        response = await self._full(chat, chat_request, base)
        if store:
            self.store.put(StoredResponse(response, messages))
        return response

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        entry = self.store.get(response_id)
        if entry is None:  # vLLM's 404 wording
            raise RequestError(f"Response with id '{response_id}' not found.", param, status=404)
        return entry

    def replay(self, response_id: str, starting_after: int | None) -> AsyncIterator[str]:
        """GET ...?stream=true: a background streamed response's events after `starting_after`
        (a sequence number; all of them when None), then the rest as they come."""
        entry = self.get(response_id)
        if entry.events is None:
            raise RequestError(f"Response with id '{response_id}' was not made with background and stream, so "
                               f"it has no events to replay: GET it without stream.", "stream")
        if starting_after is not None and starting_after < 0:
            raise RequestError(f"starting_after must be a sequence number (>= 0), got {starting_after}.",
                               "starting_after")
        return entry.events.follow(0 if starting_after is None else starting_after + 1)

    def cancel(self, response_id: str) -> ResponsesResponse:
        """A background run still queued or in progress stops and is "cancelled"; anything else is a 400."""
        entry = self.get(response_id)
        if not entry.response.background:
            raise RequestError("Cannot cancel a synchronous response.")  # vLLM's words
        if entry.response.status not in ("queued", "in_progress"):
            raise RequestError(f"Response {response_id} is already {entry.response.status}: only a queued or "
                               f"in-progress background response can be cancelled.")
        entry.response = entry.response.model_copy(update={"status": "cancelled"})
        if entry.task is not None:
            entry.task.cancel()  # aborts its engine request
        return entry.response

    # ----- the three ways to answer --------------------------------------------------------
    async def _full(self, chat: OpenAIServingChat, chat_request: ChatCompletionRequest,
                    base: ResponsesResponse) -> ResponsesResponse:
        answer: ChatCompletionResponse = await _renamed_errors(chat.create_chat_completion(chat_request))
        choice = answer.choices[0]
        message = choice.message
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]
        logprobs = token_logprobs(choice.logprobs.content if choice.logprobs else None)
        output = output_items(message.reasoning_content, message.content, calls, logprobs)
        return await self._finished(chat, base, output, choice.finish_reason, answer.usage,
                                    message.reasoning_content)

    async def _stream(self, chat: OpenAIServingChat, chat_request: ChatCompletionRequest, base: ResponsesResponse,
                      keep: Callable[[ResponsesResponse], None] | None) -> AsyncIterator[str]:
        """The typed events; `keep` gets the final response before response.completed goes out."""
        chunks = await _renamed_errors(chat.create_chat_completion(chat_request, as_sse=False))

        async def events() -> AsyncIterator[str]:
            stream = ResponseEventStream(base)
            reasoning = ""
            for event in stream.start():
                yield event
            try:
                async for chunk in chunks:
                    reasoning += "".join(c.delta.reasoning_content or "" for c in chunk.choices)
                    for event in stream.chunk(chunk):
                        yield event
                for event in stream.finish():
                    yield event
            except Exception as e:  # headers are gone: the error travels as an event
                yield stream.event("error", code=str(error_status(e)), message=public_message(e),
                                   param=getattr(e, "param", None))
                return
            finally:
                await chunks.aclose()
            response = await self._finished(chat, base, list(stream.response.output), stream.finish_reason,
                                            stream.usage, reasoning)
            if keep is not None:
                keep(response)
            yield stream.completed(response)

        return events()

    async def _background(self, chat: OpenAIServingChat, chat_request: ChatCompletionRequest,
                          base: ResponsesResponse, messages: list[dict]) -> ResponsesResponse:
        entry = StoredResponse(base.model_copy(update={"status": "queued"}), messages)
        self.store.put(entry)

        async def run() -> None:  # "queued" until it ends, as vLLM 0.11 (a client polls while queued)
            try:
                done = await self._full(chat, chat_request, base)
            except asyncio.CancelledError:
                return  # cancel() already marked it
            except Exception as e:
                logger.warning("Background response %s failed: %s", base.id, e)
                done = base.model_copy(update={"status": "failed", "error": _error_of(e)})
            finally:
                entry.task = None
            if entry.response.status != "cancelled":
                entry.response = done

        entry.task = asyncio.get_running_loop().create_task(run(), name=f"response-{base.id}")
        return entry.response

    def _background_stream(self, chat: OpenAIServingChat, chat_request: ChatCompletionRequest,
                           base: ResponsesResponse, messages: list[dict]) -> AsyncIterator[str]:
        """background + stream: the run goes on in a task that logs its events; the POST follows
        the log from the start (a client that leaves does not stop the run; /cancel does)."""
        entry = StoredResponse(base.model_copy(update={"status": "queued"}), messages, events=EventLog())
        self.store.put(entry)

        def keep(response: ResponsesResponse) -> None:
            if entry.response.status != "cancelled":
                entry.response = response

        async def run() -> None:
            try:
                async for event in await self._stream(chat, chat_request, base, keep):
                    entry.events.append(event)
                if entry.response.status == "queued":  # the stream ended in its error event
                    entry.response = base.model_copy(update={"status": "failed", "error": {
                        "code": "server_error", "message": "The run failed; its error event is in the stream."}})
            except asyncio.CancelledError:
                pass  # cancel() already marked it
            except Exception as e:  # refused before its stream began: logged as the stream would send it
                logger.warning("Background response %s failed: %s", base.id, e)
                entry.response = base.model_copy(update={"status": "failed", "error": _error_of(e)})
                entry.events.append(ResponseEventStream(base).event(
                    "error", code=str(error_status(e)), message=public_message(e), param=getattr(e, "param", None)))
            finally:
                entry.task = None
                entry.events.close()

        entry.task = asyncio.get_running_loop().create_task(run(), name=f"response-{base.id}")
        return entry.events.follow(0)

    async def _finished(self, chat: OpenAIServingChat, base: ResponsesResponse, output: list, finish_reason,
                        usage, reasoning: str | None) -> ResponsesResponse:
        """The final response: output, status (incomplete when max_output_tokens cut it), usage."""
        reasoning_tokens = len(await chat.worker.encode(reasoning, False)) if reasoning else 0
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        response_usage = ResponseUsage(
            input_tokens=usage.prompt_tokens, input_tokens_details=InputTokensDetails(cached_tokens=cached or 0),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            total_tokens=usage.prompt_tokens + usage.completion_tokens)
        incomplete = finish_reason == "length"
        return base.model_copy(update={
            "status": "incomplete" if incomplete else "completed", "output": output, "usage": response_usage,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None})


def _error_of(e: Exception) -> dict[str, str]:
    """A failed background response's `error`."""
    return {"code": "server_error" if error_status(e) == 500 else "invalid_request", "message": public_message(e)}


def _chat_request(request: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat request that answers `request`; its 400s name the Responses fields."""
    tools = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
             for t in request.function_tools()]
    body: dict[str, Any] = {"model": request.model, "messages": messages, "stream": request.stream}
    for name in ("temperature", "top_p", "top_k", "repetition_penalty", "logit_bias", "seed", "user", "request_id"):
        if getattr(request, name) is not None:
            body[name] = getattr(request, name)
    if request.ignore_eos:
        body["ignore_eos"] = True
    if request.max_output_tokens is not None:
        body["max_completion_tokens"] = request.max_output_tokens
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    if request.output_logprobs():
        body["logprobs"], body["top_logprobs"] = True, request.top_logprobs or 0
    if tools:
        body["tools"], body["parallel_tool_calls"] = tools, request.parallel_tool_calls
        choice = request.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                       "function": {"name": choice.name}}
    elif request.tool_choice not in ("auto", "none"):
        raise RequestError("tool_choice needs tools: add the functions to tools or drop tool_choice.",
                           "tool_choice")
    text_format = request.text.format if request.text else None
    if text_format is not None and text_format.type != "text":
        schema = {"name": text_format.name or "response", "schema": text_format.json_schema,
                  "strict": text_format.strict}
        body["response_format"] = {"type": text_format.type,
                                   **({"json_schema": schema} if text_format.type == "json_schema" else {})}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(part) for part in first["loc"][:1]) or None
        field = FIELD_NAMES.get(field, field)
        raise RequestError(f"{field}: {str(first['msg']).removeprefix('Value error, ')}", field) from None


async def _renamed_errors(work):
    """Await the chat path; its RequestErrors name the Responses fields (max_output_tokens, input)."""
    try:
        return await work
    except RequestError as e:
        message = str(e)
        for chat_name, name in FIELD_NAMES.items():
            message = message.replace(chat_name, name)
        raise RequestError(message, FIELD_NAMES.get(e.param, e.param), e.status) from None
