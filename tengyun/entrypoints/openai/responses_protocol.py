"""The Responses API's request and response models (POST /v1/responses), in OpenAI's and vLLM
0.11's field names. A request is turned into chat messages (responses_input.py) and served by
the chat path; these models only say what a client may send and what it gets back.

    request:  input (a string, or items: messages, function_call, function_call_output),
              instructions, tools (function tools) + tool_choice, text.format, max_output_tokens,
              temperature / top_p, include (output logprobs) + top_logprobs, stream, store,
              previous_response_id, background
    response: {"id": "resp_...", "object": "response", "status", "output": [reasoning item,
              message item, function_call items], "usage": {input_tokens, output_tokens, ...}}
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tengyun.entrypoints.openai.protocol import FunctionDefinition
from tengyun.entrypoints.openai.request_model import (
    OpenAIBaseModel, RequestBody, RequestError, RequestModel,
)


# ----- request ---------------------------------------------------------------------------
class FunctionTool(FunctionDefinition):
    """A Responses function tool: chat's function definition flat, not nested under "function"."""

    type: Literal["function"] = "function"


class NamedFunctionChoice(RequestModel):
    type: Literal["function"] = "function"
    name: str


class TextFormat(RequestModel):
    """text.format: "text", "json_object", or "json_schema" with its name and schema (flat)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_present(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('text.format of type "json_schema" needs its schema.')
        return self


class TextConfig(RequestModel):
    format: TextFormat | None = None


# what `include` may ask for (OpenAI's values, as vLLM 0.11 lists them); only output logprobs is served
IncludeValue = Literal["code_interpreter_call.outputs", "computer_call_output.output.image_url",
                       "file_search_call.results", "message.input_image.image_url", "message.output_text.logprobs",
                       "reasoning.encrypted_content"]


class ResponsesRequest(RequestBody):
    model: str | None = None
    include: list[IncludeValue] | None = None
    top_logprobs: int | None = 0  # with include message.output_text.logprobs: alternatives per token
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # checked one by one: a 400 names tools[i]
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extras, as on chat: top_k, repetition_penalty, logit_bias, ignore_eos
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": ...}: accepted; the template decides
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] = "disabled"
    service_tier: str = "auto"
    request_id: str | None = None  # vLLM's: the answer's id becomes resp_<request_id>

    @model_validator(mode="after")
    def _check(self):
        if self.background and not self.store:
            raise ValueError("background can only be used when `store` is true")
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must hold at least one item.")
        return self

    @field_validator("max_output_tokens")
    @classmethod
    def _at_least_one(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"max_output_tokens must be at least 1, got {value}.")
        return value

    def output_logprobs(self) -> bool:
        """include asks for the answer's token logprobs (vLLM's is_include_output_logprobs)."""
        return "message.output_text.logprobs" in (self.include or [])

    def function_tools(self) -> list[FunctionTool]:
        """tools as function tools; a tool of another type (web_search, mcp, ...) is a 400."""
        tools = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise RequestError(f"tools[{i}]: tool type {tool.get('type')!r} is not supported; this server "
                                   f"runs function tools only.", f"tools[{i}].type")
            try:
                tools.append(FunctionTool.model_validate(tool))
            except ValueError as e:
                raise RequestError(f"tools[{i}]: {e}", f"tools[{i}]") from None
        return tools


# ----- response --------------------------------------------------------------------------
def item_id(prefix: str) -> str:
    """OpenAI's id form: msg_..., rs_..., fc_... (resp_... for the response)."""
    return f"{prefix}_{uuid.uuid4().hex}"


class TopLogprob(OpenAIBaseModel):
    token: str
    bytes: list[int] | None = None  # the token's UTF-8 bytes
    logprob: float


class TokenLogprob(TopLogprob):
    """One answer token: its logprob and the top_logprobs most likely tokens at its step."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list)  # filled when include asks for them


class OutputMessage(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: item_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIBaseModel):
    """--reasoning-parser's part of the answer, as vLLM 0.11 sends it: content, no summary."""

    id: str = Field(default_factory=lambda: item_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: item_id("fc"))
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


Status = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class ResponsesResponse(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: Status
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str = "auto"
    store: bool = True
    background: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None  # the request's, when include asked for logprobs
    text: dict[str, Any] | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: str = "disabled"
    user: str | None = None

    @classmethod
    def of_request(cls, request: ResponsesRequest, response_id: str, model: str, status: Status,
                   **fields: Any) -> "ResponsesResponse":
        """A response echoing the request's settings, as OpenAI and vLLM answer."""
        fields.setdefault("store", request.store)
        return cls(id=response_id, model=model, status=status, instructions=request.instructions,
                   max_output_tokens=request.max_output_tokens, metadata=request.metadata,
                   parallel_tool_calls=request.parallel_tool_calls,
                   previous_response_id=request.previous_response_id, reasoning=request.reasoning,
                   background=request.background, temperature=request.temperature,
                   top_p=request.top_p, user=request.user,
                   top_logprobs=request.top_logprobs if request.output_logprobs() else None,
                   text=request.text.model_dump(by_alias=True, exclude_none=True) if request.text else None,
                   tool_choice=(request.tool_choice if isinstance(request.tool_choice, str)
                                else request.tool_choice.model_dump()),
                   tools=list(request.tools or []), **fields)
