"""Request and response bodies of the pooling routes, with vLLM 0.11's field names:
/v1/embeddings (OpenAI's), /pooling, /classify, /score (/v1/score), /rerank (/v1/rerank, /v2/rerank:
Jina's and Cohere's shape)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, model_validator

from tengyun.entrypoints.openai.protocol import ChatMessage, UsageInfo
from tengyun.entrypoints.openai.request_model import OpenAIBaseModel, RequestBody, RequestError
from tengyun.pooling_params import PoolingParams

PromptInput = str | list[str] | list[int] | list[list[int]]


class PoolingFields(RequestBody):
    """What every pooling request may carry besides its inputs."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # keep the last k tokens; -1: --max-model-len
    add_special_tokens: bool = True
    priority: int = 0  # only 0: requests run in arrival order (as on the generative routes)
    request_id: str | None = None  # the response id is "<prefix>-<request_id>" when given

    @model_validator(mode="after")
    def _no_priority(self):
        if self.priority:
            raise ValueError("priority is not supported by this server (requests run in arrival order); remove it.")
        return self

    def pooling_params(self, task: str, **fields) -> PoolingParams:
        return PoolingParams(task=task, truncate_prompt_tokens=self.truncate_prompt_tokens, **fields)


def prompt_list(value: PromptInput, field: str) -> list[str | list[int]]:
    """"a" -> ["a"], [1, 2] -> [[1, 2]], ["a", "b"] and [[1], [2]] as they are; [] -> [] (vLLM answers
    an empty list with no data); an empty token list inside a list refused."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    if any(isinstance(v, list) and not v for v in value):
        raise RequestError(f"{field} must not be empty.", field)
    return list(value)


class ChatInputFields(RequestBody):
    """vLLM's chat form of /v1/embeddings and /pooling: ``messages`` rendered by the chat template
    (the request's, --chat-template, or the tokenizer's) instead of ``input``; special tokens are
    not added on top of the template unless add_special_tokens says so (vLLM's default)."""

    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _input_or_messages(self):
        if (self.input is None) == (self.messages is None):
            raise ValueError("Give either input (texts or token ids) or messages (a conversation), not both.")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return self


class EmbeddingRequest(PoolingFields, ChatInputFields):
    input: PromptInput | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka models only
    normalize: bool | None = None

    def to_pooling_params(self) -> PoolingParams:
        return self.pooling_params("embed", dimensions=self.dimensions, normalize=self.normalize)


class PoolingRequest(EmbeddingRequest):
    task: Literal["embed", "encode", "classify", "reward", "score"] | None = None  # None: encode
    activation: bool | None = None
    softmax: bool | None = None

    def to_pooling_params(self) -> PoolingParams:
        task = self.task or "encode"
        fields = dict(dimensions=self.dimensions, normalize=self.normalize, activation=self.activation,
                      softmax=self.softmax)
        return self.pooling_params(task, **{k: v for k, v in fields.items() if v is not None})


class ClassificationRequest(PoolingFields):
    input: PromptInput
    activation: bool | None = None
    softmax: bool | None = None

    def to_pooling_params(self) -> PoolingParams:
        return self.pooling_params("classify", activation=self.activation, softmax=self.softmax)


class ScoreRequest(PoolingFields):
    text_1: str | list[str]
    text_2: str | list[str]
    activation: bool | None = None
    softmax: bool | None = None


class RerankRequest(PoolingFields):
    query: str
    documents: list[str]
    top_n: int = 0  # 0 (or more than there are): every document
    return_documents: bool = True
    activation: bool | None = None
    softmax: bool | None = None

    @model_validator(mode="after")
    def _check(self):
        if not self.documents:
            raise ValueError("documents must not be empty.")
        if self.top_n < 0:
            raise ValueError(f"top_n must be >= 0, got {self.top_n}.")
        return self


# ----- responses ------------------------------------------------------------------------------
class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: str = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: str = "pooling"
    data: list[list[float]] | list[float] | str


class PoolingResponse(EmbeddingResponse):
    data: list[PoolingResponseData]


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(EmbeddingResponse):
    data: list[ClassificationData]


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(EmbeddingResponse):
    data: list[ScoreResponseData]


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
