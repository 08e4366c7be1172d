"""POST /v1/embeddings, /pooling and /classify on a --runner pooling server: one engine request per
input, run together (the scheduler batches them under the token budget), answered in input order.

A generative server answers these 400 naming --runner pooling, and a pooling server answers the
generative routes the same way (require_runner)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from tengyun.entrypoints.openai.embedding_chunks import embed_in_chunks
from tengyun.entrypoints.openai.pooling_protocol import (
    ClassificationData, ClassificationRequest, ClassificationResponse, EmbeddingRequest, EmbeddingResponse,
    EmbeddingResponseData, PoolingRequest, PoolingResponse, PoolingResponseData, prompt_list,
)
from tengyun.entrypoints.openai.protocol import UsageInfo
from tengyun.entrypoints.openai.request_model import RequestError
from tengyun.entrypoints.openai.serving_engine import OpenAIServing
from tengyun.pooling_outputs import PoolingRequestOutput
from tengyun.pooling_params import PoolingParams

API_NAMES = {"generate": "Completions and Chat Completions APIs", "pooling": "pooling APIs (embeddings, "
             "pooling, classify, score, rerank)"}


def require_runner(config: Any, runner: str) -> None:
    """RequestError (400) when the served model runs the other runner than ``runner`` needs."""
    pooling = config.pooling is not None
    if pooling == (runner == "pooling"):
        return
    if pooling:
        raise RequestError(f"The model does not support the {API_NAMES['generate']}: it is served with --runner "
                           f"pooling ({config.pooling.describe()}); serve a generative model with --runner "
                           f"generate for text.")
    raise RequestError(f"The model does not support the {API_NAMES['pooling']}: it generates text (--runner "
                       f"generate); serve an embedding or reranking model with --runner pooling.")


class OpenAIServingPooling(OpenAIServing):
    async def pool(self, request_id: str, prompts: list[str | list[int]], params: list[PoolingParams],
                   add_special_tokens: bool, field: str) -> list[PoolingRequestOutput]:
        """Each prompt's pooled output, in prompt order; bad input raises before anything runs."""
        require_runner(self.engine.config, "pooling")
        self.check_prompt_count(len(prompts), field)
        token_lists = await self.tokenize_prompts(prompts, add_special_tokens)
        return await self.run_token_lists(request_id, token_lists, params, field)

    async def tokenize_prompts(self, prompts: list[str | list[int]], add_special_tokens: bool) -> list[list[int]]:
        return [p if isinstance(p, list) else await self.tokenize_prompt(p, add_special_tokens) for p in prompts]

    async def run_token_lists(self, request_id: str, token_lists: list[list[int]], params: list[PoolingParams],
                              field: str) -> list[PoolingRequestOutput]:
        """One engine request per token list, run together; their outputs in order."""
        for ids in token_lists:
            self.check_token_ids(ids, field)
        streams = [self.engine.generate(f"{request_id}-{i}", ids, p, first_turn=i)
                   for i, (ids, p) in enumerate(zip(token_lists, params))]
        finals: dict[int, PoolingRequestOutput] = {}
        async for i, output in self.merged(streams):
            finals[i] = output
        if any(output.outputs.data is None for output in finals.values()):  # aborted: the server is stopping
            raise RequestError("The request was aborted before its inputs were computed (the server is shutting "
                               "down); send it again.", status=503)
        return [finals[i] for i in range(len(token_lists))]

    def check_prompt_count(self, count: int, field: str) -> None:
        if count > self.limits.max_prompts_per_request:
            raise RequestError(f"The request lists {count} inputs but this server allows at most "
                               f"{self.limits.max_prompts_per_request} (--max-prompts-per-request): send them in "
                               f"several requests.", field)

    def keeps_no_tokens(self, truncate_prompt_tokens: int | None) -> bool:
        """vLLM's pooling routes: truncate_prompt_tokens above --max-model-len is a 400 in its words,
        before anything is tokenized; 0 keeps no token of any input, so nothing is pooled (an answer
        with no data and 0 prompt tokens)."""
        if truncate_prompt_tokens is not None and truncate_prompt_tokens > self.max_model_len:
            raise RequestError("truncate_prompt_tokens value is greater than max_model_len. Please, select a "
                               "smaller truncation size.", "truncate_prompt_tokens")
        return truncate_prompt_tokens == 0

    def pooling_usage(self, outputs: list[PoolingRequestOutput]) -> UsageInfo:
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)

    async def _pool_inputs(self, request: Any, prefix: str, chunked: bool = False,
                           ) -> tuple[str, list[PoolingRequestOutput]]:
        """(the answer's id, the pooled outputs) of a request whose ``input`` (or ``messages``) holds
        the prompts: one id for the engine's requests and the answer. ``chunked``: a long input is
        pooled in chunks (embedding_chunks.py)."""
        self.check_model(request.model)
        require_runner(self.engine.config, "pooling")  # before the no-data answers below
        response_id = self.response_id(prefix, request)
        if self.keeps_no_tokens(request.truncate_prompt_tokens):
            return response_id, []
        add_special_tokens, field = request.add_special_tokens, "input"
        if getattr(request, "messages", None) is not None:
            prompts = [await self.render_chat(request.messages, request.add_generation_prompt,
                                              request.continue_final_message, request.chat_template,
                                              request.chat_template_kwargs)]
            # the template holds BOS and friends: special tokens on top only when asked (vLLM's default)
            add_special_tokens = "add_special_tokens" in request.model_fields_set and request.add_special_tokens
            field = "messages"
        else:
            prompts = prompt_list(request.input, "input")
        if not prompts:  # vLLM answers an empty list with no data and 0 tokens
            return response_id, []
        params = request.to_pooling_params()
        if chunked and request.truncate_prompt_tokens is None:  # truncation makes an input fit instead
            require_runner(self.engine.config, "pooling")
            self.check_prompt_count(len(prompts), field)
            token_lists = await self.tokenize_prompts(prompts, add_special_tokens)
            return response_id, await embed_in_chunks(self, response_id, token_lists, params, field)
        return response_id, await self.pool(response_id, prompts, [params] * len(prompts), add_special_tokens, field)

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        pooling = self.engine.config.pooling
        response_id, outputs = await self._pool_inputs(request, "embd", pooling is not None and
                                                       pooling.chunked_processing)
        data = [EmbeddingResponseData(index=i, embedding=encode(o.outputs.data, request.encoding_format))
                for i, o in enumerate(outputs)]
        return EmbeddingResponse(id=response_id, model=self.served_model_name, data=data,
                                 usage=self.pooling_usage(outputs))

    async def create_pooling(self, request: PoolingRequest) -> PoolingResponse:
        response_id, outputs = await self._pool_inputs(request, "pool")
        data = [PoolingResponseData(index=i, data=encode(o.outputs.data, request.encoding_format))
                for i, o in enumerate(outputs)]
        return PoolingResponse(id=response_id, model=self.served_model_name, data=data,
                               usage=self.pooling_usage(outputs))

    async def create_classify(self, request: ClassificationRequest) -> ClassificationResponse:
        response_id, outputs = await self._pool_inputs(request, "classify")
        labels = self.engine.config.pooling.id2label
        data = []
        for i, output in enumerate(outputs):
            probs = list(output.outputs.data)
            best = int(np.argmax(probs))
            data.append(ClassificationData(index=i, label=labels[best] if best < len(labels) else None, probs=probs,
                                           num_classes=len(probs)))
        return ClassificationResponse(id=response_id, model=self.served_model_name,
                                      data=data, usage=self.pooling_usage(outputs))


def encode(data: list, encoding_format: str) -> list | str:
    """float: the list as it is; base64: its little-endian float32 bytes (what the OpenAI SDK decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(data, dtype="<f4").tobytes()).decode("ascii")
    return data
