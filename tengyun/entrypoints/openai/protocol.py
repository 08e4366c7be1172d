"""OpenAI API request / response models (pydantic), with vLLM's extra fields. The shared pieces
live in request_model.py (the strict, Unicode-only base) and sampling_fields.py."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_serializer, model_validator

from tengyun.entrypoints.openai.request_model import OpenAIBaseModel, RequestBody, RequestError, RequestModel
from tengyun.entrypoints.openai.sampling_fields import SamplingFields
from tengyun.outputs import PromptLogprobs
from tengyun.sampling_params import SamplingParams, StructuredOutputsParams

MIN_LOGPROB = -9999.0  # -inf becomes this, as vLLM and OpenAI send it (JSON has no infinity)


# ----- errors ----------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestTooLargeError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """{"error": {"message", "type", "param", "code"}}, the one error shape of every route."""
    return ErrorResponse(error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "Error"),
                                         param=param, code=status)).model_dump()


# ----- shared pieces ---------------------------------------------------------------------
class PromptLogprob(OpenAIBaseModel):
    """vLLM's Logprob as JSON: {"logprob": -1.2, "rank": 3, "decoded_token": " fox"}."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def prompt_logprobs_json(entries: PromptLogprobs | None) -> list[dict[int, PromptLogprob] | None] | None:
    """RequestOutput.prompt_logprobs -> the response's `prompt_logprobs` (token ids become JSON keys)."""
    if entries is None:
        return None
    return [None if entry is None else
            {token: PromptLogprob(logprob=max(lp.logprob, MIN_LOGPROB), rank=lp.rank, decoded_token=lp.decoded_token)
             for token, lp in entry.items()}
            for entry in entries]


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None  # prompt tokens whose KV came from the prefix cache


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None  # --enable-prompt-tokens-details


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tengyun"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ----- /v1/completions -------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    # --enable-prompt-embeds: base64 of torch.save()d [seq_len, hidden_size] tensors, answered before
    # the prompts (as vLLM); completion_embeds.py reads them.
    prompt_embeds: str | list[str] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: BOS and friends around the prompt text, as the tokenizer adds them
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.suffix:
            raise ValueError("suffix is not supported by this server; remove it.")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported by this server; set it equal to n or remove it.")
        if self.logprobs is not None and self.logprobs < 0:  # no -1 here, as vLLM
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}.")
        if self.prompt in (None, "") and not self.prompt_embeds:  # vLLM's check and words ([] and [""] pass)
            raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
        return self

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) back, nothing generated. As vLLM,
        the engine runs with max_tokens 1 and the token is dropped."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """"a" -> ["a"], [1, 2] -> [[1, 2]], ["a", "b"] and [[1], [2]] unchanged; none beside
        prompt_embeds when the prompt is missing or "" (as vLLM)."""
        prompt = self.prompt
        if prompt is None or (prompt == "" and self.prompt_embeds):
            return []
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise RequestError("prompt must not be empty.", "prompt")
        return list(prompt)

    @property
    def max_tokens_set(self) -> bool:
        """The client sent max_tokens (a number or null); unset, the server's default applies."""
        return "max_tokens" in self.model_fields_set

    def to_sampling_params(self, max_tokens: int | None,
                           structured_outputs: StructuredOutputsParams | None = None,
                           defaults: dict[str, Any] | None = None) -> SamplingParams:
        """echo with logprobs N scores the prompt with N alternatives too, unless prompt_logprobs says otherwise."""
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs
        return self._sampling_params(1 if self.echo_only else max_tokens, self.logprobs, structured_outputs,
                                     prompt_logprobs, defaults)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None  # vLLM's extra
    token_ids: list[int] | None = None  # return_token_ids: this choice's tokens (streamed: the new ones)
    prompt_token_ids: list[int] | None = None  # return_token_ids (streamed: on a choice's first chunk)


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ----- /v1/chat/completions --------------------------------------------------------------
class ChatMessage(RequestModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id, ... reach the template
    role: str
    content: str | list[dict[str, Any]] | None = None


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolParam(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = Field(False, strict=False)  # as vLLM's lax model: "true" (a string) is true
    top_logprobs: int | None = None
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # False: drop reasoning_content from the answer
    echo: bool = False  # the last message's content first in the answer, when it is the assistant's
    add_special_tokens: bool = False  # on top of the template's own (which already holds BOS)

    @model_validator(mode="after")
    def _check(self):
        if not self.messages:
            raise ValueError("messages must hold at least one message.")
        if self.top_logprobs is not None:  # as vLLM: -1 is the whole vocabulary, 0 needs no logprobs
            if self.top_logprobs < -1:
                raise ValueError(f"top_logprobs must be >= 0, or -1 for the whole vocabulary, "
                                 f"got {self.top_logprobs}.")
            if self.top_logprobs != 0 and not self.logprobs:
                raise ValueError("top_logprobs needs logprobs set to true.")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools: add the functions to tools or drop tool_choice.")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in {
                t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, which is "
                             f"not in tools ({', '.join(t.function.name for t in self.tools)}).")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true; "
                             "set add_generation_prompt to false.")
        return self

    @property
    def echo_text(self) -> str:
        """echo: the final assistant message (being continued) starts the answer, as vLLM answers."""
        last = self.messages[-1]
        return last.content if self.echo and last.role == "assistant" and isinstance(last.content, str) else ""

    @property
    def tool_choice_forces_calls(self) -> bool:
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int | None,
                           structured_outputs: StructuredOutputsParams | None = None,
                           defaults: dict[str, Any] | None = None) -> SamplingParams:
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None,
                                     structured_outputs, self.prompt_logprobs, defaults)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # --reasoning-parser: the <think> part
    reasoning: str | None = None  # the same text under the newer field name
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None  # vLLM's extra
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the tokens this chunk adds

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: DeltaMessage) -> dict:
        return delta.model_dump(exclude_none=True)  # {"content": "x"}, not {"role": null, ...}


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the first chunk


# ----- /tokenize, /detokenize ------------------------------------------------------------
class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolParam] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _check(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("pass exactly one of prompt or messages.")
        return self


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
