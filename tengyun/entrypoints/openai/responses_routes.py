"""The Responses API's routes (serving_responses.py holds what they do):

    POST /v1/responses                  create (JSON, or typed SSE events with "stream": true)
    GET  /v1/responses/{id}             a stored response (404 "Response with id '...' not found.");
                                        ?stream=true&starting_after=N: a background streamed
                                        response's events after sequence number N
    POST /v1/responses/{id}/cancel      stop a background response

Behind the same gate as the other /v1 routes (API key, body size, start-up and drain 503s).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tengyun.entrypoints.openai.protocol import ErrorResponse
from tengyun.entrypoints.openai.responses import respond, until_disconnect
from tengyun.entrypoints.openai.responses_protocol import ResponsesRequest
from tengyun.entrypoints.openai.responses_store import ResponsesStore
from tengyun.entrypoints.openai.serving_pooling import require_runner
from tengyun.entrypoints.openai.serving_responses import OpenAIServingResponses


NOT_FOUND = {404: {"model": ErrorResponse, "description": "No stored response has this id"}}
EVENTS = {200: {"content": {"text/event-stream": {"schema": {"type": "object"}}},  # each event's data
                "description": "The response (JSON), or with stream true its typed events"}}


def add_responses_routes(app: FastAPI, host: Any) -> None:
    """``host``: the EngineHost whose chat handler (host.chat, made once the engine is up) serves them."""
    serving = OpenAIServingResponses(lambda: host.chat, ResponsesStore())

    @app.post("/v1/responses", responses={**NOT_FOUND, **EVENTS})  # previous_response_id, or model, unknown
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        require_runner(host.config, "generate")
        return respond(await until_disconnect(raw_request, serving.create(request)))

    @app.get("/v1/responses/{response_id}", responses={**NOT_FOUND, **EVENTS})
    async def retrieve_response(response_id: str, stream: bool = False, starting_after: int | None = None) -> Response:
        if stream:  # a background streamed response's events (after starting_after), as they come
            return respond(serving.replay(response_id, starting_after))
        return JSONResponse(serving.get(response_id).response.model_dump())

    @app.post("/v1/responses/{response_id}/cancel", responses=NOT_FOUND)
    async def cancel_response(response_id: str) -> JSONResponse:
        return JSONResponse(serving.cancel(response_id).model_dump())
