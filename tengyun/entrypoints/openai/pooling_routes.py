"""The pooling routes (docs/pooling.md), vLLM's paths: POST /v1/embeddings, /pooling, /classify,
/score and /v1/score, /rerank, /v1/rerank and /v2/rerank. Behind the same gate as /v1/* (API key,
body size, readiness); a generative server answers them 400 naming --runner pooling. POST /invocations
on a pooling server picks one of them from the body (pooling_invocation)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tengyun.entrypoints.openai.pooling_protocol import (
    ClassificationRequest, EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest,
)
from tengyun.entrypoints.openai.request_model import RequestError
from tengyun.entrypoints.openai.responses import respond, until_disconnect

SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
POOLING_PATHS = ("/v1/embeddings", "/pooling", "/classify", *SCORE_PATHS, *RERANK_PATHS)


def add_pooling_routes(app: FastAPI, host: Any) -> None:
    """``host``: the EngineHost; host.pooling (serving_score.OpenAIServingScore) is set once the engine is ready."""
    @app.post("/v1/embeddings")
    async def embeddings(request: EmbeddingRequest, raw_request: Request) -> Response:
        return respond(await until_disconnect(raw_request, host.pooling.create_embedding(request)))

    @app.post("/pooling")
    async def pooling(request: PoolingRequest, raw_request: Request) -> Response:
        return respond(await until_disconnect(raw_request, host.pooling.create_pooling(request)))

    @app.post("/classify")
    async def classify(request: ClassificationRequest, raw_request: Request) -> Response:
        return respond(await until_disconnect(raw_request, host.pooling.create_classify(request)))

    async def score(request: ScoreRequest, raw_request: Request) -> Response:
        return respond(await until_disconnect(raw_request, host.pooling.create_score(request)))

    async def rerank(request: RerankRequest, raw_request: Request) -> Response:
        return respond(await until_disconnect(raw_request, host.pooling.create_rerank(request)))

    for path in SCORE_PATHS:
        app.post(path)(score)
    for path in RERANK_PATHS:
        app.post(path)(rerank)


def pooling_invocation(host: Any, body: dict, validate: Callable[[type, dict], Any]) -> Awaitable:
    """SageMaker's /invocations on a pooling server, as vLLM routes it: a score body (text_1, text_2)
    to /score, a rerank body (query, documents) to /rerank, and an input or messages body to the
    route of the model's conversion (embed: /v1/embeddings, classify: /classify, reward: /pooling)."""
    serving = host.pooling
    if "text_1" in body:
        return serving.create_score(validate(ScoreRequest, body))
    if "query" in body:
        return serving.create_rerank(validate(RerankRequest, body))
    if "input" in body or "messages" in body:
        request_type, create = {"embed": (EmbeddingRequest, serving.create_embedding),
                                "classify": (ClassificationRequest, serving.create_classify),
                                "reward": (PoolingRequest, serving.create_pooling)}[host.config.pooling.convert]
        return create(validate(request_type, body))
    raise RequestError("/invocations on a pooling model takes an embeddings, classify or pooling body (input or "
                       "messages), a score body (text_1, text_2) or a rerank body (query, documents).", "input")
