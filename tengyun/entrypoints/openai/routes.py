"""build_app: the FastAPI app in front of an EngineHost: middleware, error handlers, routes.

    CORSMiddleware (outermost: preflights never need the key)
      ResponseCounter (tengyun:http_responses_total by status class, the gate's refusals too)
        GateMiddleware (auth 401, body size 413, lifecycle 503, in-flight counting)
          routes: /health, /health/detail, /metrics, /version (open);
                  /v1/models, /v1/completions, /v1/chat/completions, /tokenize, /detokenize;
                  vLLM's /load, /tokenizer_info, /invocations (vllm_routes.py);
                  /v1/load_lora_adapter, /v1/unload_lora_adapter (lora_routes.py)
                  /v1/responses, GET /v1/responses/{id}, POST .../cancel (responses_routes.py)

Every error leaves in OpenAI's shape ({"error": {"message", "type", "param", "code"}}): a bad
body 400 naming the field, never FastAPI's 422; an unexpected exception 500 without its text.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from tengyun import __version__
from tengyun.engine.async_engine import EngineDeadError
from tengyun.entrypoints.openai.engine_host import EngineHost
from tengyun.entrypoints.openai.lora_routes import add_lora_routes
from tengyun.entrypoints.openai.middleware import GateMiddleware, RequestTooLarge, ResponseCounter, error_response
from tengyun.entrypoints.openai.openapi_doc import install_openapi
from tengyun.entrypoints.openai.pooling_routes import add_pooling_routes
from tengyun.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, ModelList,
    RequestError, TokenizeRequest, TokenizeResponse,
)
from tengyun.entrypoints.openai.responses import respond, until_disconnect
from tengyun.entrypoints.openai.responses_routes import add_responses_routes
from tengyun.entrypoints.openai.serving_engine import error_status, public_message
from tengyun.entrypoints.openai.serving_pooling import require_runner
from tengyun.entrypoints.openai.vllm_routes import add_vllm_routes

logger = logging.getLogger("tengyun.server")
NODE_QUERY_TIMEOUT_S = 2.0  # the engine reads the node link at least every 0.5 s while idle


def build_app(host: EngineHost) -> FastAPI:
    server = host.server
    no_docs = dict(docs_url=None, redoc_url=None, openapi_url=None) if server.disable_fastapi_docs else {}
    app = FastAPI(title="Tengyun OpenAI-compatible server", version=__version__,
                  lifespan=lambda app: host.running(), **no_docs)
    app.root_path = server.root_path or ""  # --root-path, as vLLM sets it: routes answer with and without the prefix
    app.state.server = host
    http_responses = Counter("tengyun:http_responses", "HTTP responses by status class (2xx, 4xx, 5xx).",
                             ["status"], registry=host.metrics.registry)
    app.add_middleware(GateMiddleware, host=host)
    app.add_middleware(ResponseCounter, counter=http_responses)
    app.add_middleware(CORSMiddleware, allow_origins=list(server.allowed_origins) or ["*"],
                       allow_methods=list(server.allowed_methods) or ["*"],
                       allow_headers=list(server.allowed_headers) or ["*"],
                       allow_credentials=server.allow_credentials)  # outermost: preflights never need the key
    _add_error_handlers(app)
    _add_health_routes(app, host)
    _add_api_routes(app, host)
    add_vllm_routes(app, host)
    add_pooling_routes(app, host)
    add_lora_routes(app, host)
    add_responses_routes(app, host)
    install_openapi(app, with_api_key=bool(server.required_api_key))
    return app


def health_json(host: EngineHost, nodes: list[dict] | None = None) -> dict:
    """GET /health/detail: what /health decides from, plus the engine's load, the devices'
    latest sample (the sampler's, never read here) and, in a multi-node launch, each headless
    node's state as the engine's node link reports it (``nodes``; None when it did not answer)."""
    lifecycle = host.lifecycle
    reason = lifecycle.unavailable_reason()
    stats = host.engine.latest_stats if host.engine is not None else None
    sample = host.device_sampler.latest if host.device_sampler else None
    return {
        "status": "ok" if reason is None else "unavailable", "reason": reason,
        "engine": {"state": lifecycle.engine_state(), "warmed_up": lifecycle.ready, "draining": lifecycle.draining,
                   "in_flight": lifecycle.in_flight,
                   **({"running": stats.num_running, "waiting": stats.num_waiting,
                       "kv_cache_usage": stats.kv_cache_usage, "kv_cache_blocks": stats.num_kv_blocks}
                      if stats is not None else {})},
        "device_type": host.config.device_type,
        # each of this node's ranks: weights, the profile step's measured peak, KV, headroom (bytes)
        "memory": host.engine.memory_reports if host.engine is not None else None,
        "node": host.device_sampler.node if host.device_sampler else None,
        **(sample.as_json() if sample is not None else {"devices": None, "links": None}),
        **({"nodes": nodes} if host.config.nnodes > 1 else {}),
        # --data-parallel-size > 1: each replica (vLLM's engine label), alive or why not, and its load
        **({"data_parallel": host.engine.replica_states()}
           if host.config.data_parallel_size > 1 and host.engine is not None else {}),
    }


async def node_states(host: EngineHost) -> list[dict] | None:
    """The engine's view of the headless nodes (executor/node_link.py), None on one node or when the
    engine does not answer within NODE_QUERY_TIMEOUT_S (still starting, or dead)."""
    config = host.config
    if config.nnodes <= 1 or host.lifecycle.engine is None or host.lifecycle.engine.errored:
        return None
    from tengyun.executor.node_link import query_nodes

    return await asyncio.to_thread(query_nodes, config.master_addr, config.master_port, NODE_QUERY_TIMEOUT_S)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"The request body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = str(first.get("msg", "Invalid request.")).removeprefix("Value error, ")
        if loc:
            message = f"{'.'.join(loc)}: {message}"
        elif first.get("type") in ("model_attributes_type", "dict_type", "missing"):
            message = f"The request body must be a JSON object: {message}"
        return error_response(400, message, loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, RequestTooLarge):  # FastAPI wraps errors met while reading the body
            return error_response(413, str(exc.__cause__))
        message = f"No route {request.method} {request.url.path}." if exc.status_code in (404, 405) else str(exc.detail)
        return error_response(exc.status_code, message)

    @app.exception_handler(RequestTooLarge)
    async def too_large(request: Request, exc: RequestTooLarge) -> JSONResponse:
        return error_response(413, str(exc))

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc.status, str(exc), exc.param)

    @app.exception_handler(ValueError)
    async def value_error(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(error_status(exc), str(exc))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("Internal error on %s", request.url.path)
        return error_response(500, public_message(exc))  # never the exception's text


def _add_health_routes(app: FastAPI, host: EngineHost) -> None:
    """Open to probes and scrapers: they carry no key."""
    @app.get("/health")
    async def health() -> Response:
        reason = host.lifecycle.unavailable_reason()
        return Response(status_code=200) if reason is None else error_response(503, reason)

    @app.get("/health/detail")
    async def health_detail() -> JSONResponse:
        """Open like /health; the same status code, with what it is made of."""
        body = health_json(host, await node_states(host))
        return JSONResponse(body, status_code=200 if body["reason"] is None else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(host.scrape_registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}


def _add_api_routes(app: FastAPI, host: EngineHost) -> None:
    @app.get("/v1/models")
    async def models() -> dict:
        # root: the name the model is served under, never the folder it was loaded or converted into;
        # then each LoRA adapter, its parent the base model (serving_models.py)
        return ModelList(data=host.models.cards()).model_dump()

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        require_runner(host.config, "generate")
        return respond(await until_disconnect(raw_request, host.completion.create_completion(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        require_runner(host.config, "generate")
        return respond(await until_disconnect(raw_request, host.chat.create_chat_completion(request)))

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict:
        serving = host.completion
        serving.check_model(request.model)
        if request.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
            text = await serving.render_chat(request.messages, request.add_generation_prompt,
                                             request.continue_final_message, request.chat_template,
                                             request.chat_template_kwargs, tools)
            add_special = bool(request.add_special_tokens)
        else:
            text = request.prompt
            add_special = request.add_special_tokens is not False
        tokens = await serving.worker.encode(text, add_special)
        token_strs = serving.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=serving.max_model_len, tokens=tokens,
                                token_strs=token_strs).model_dump()

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict:
        serving = host.completion
        serving.check_model(request.model)
        text = await serving.worker.run(serving.detokenize, request.tokens)  # a long list: off the event loop
        return DetokenizeResponse(prompt=text).model_dump()
