"""GateMiddleware: what every API request passes before a route sees it, in this order:
bearer auth (401), body size (413), readiness / draining (503), then in-flight counting.

Route classes:
    /v1/*, /tokenize, /detokenize,    all of it
    /invocations, /tokenizer_info,
    /pooling, /classify, /score,
    /rerank, /v2/rerank
    /docs, /redoc, /openapi.json      the key, when --api-key is set (they describe the API)
    /health, /health/detail,          open: probes and scrapers carry no key
    /metrics, /version, /load
ResponseCounter, outside the gate, counts every response by status class (its refusals too).
"""

from __future__ import annotations

import secrets
import uuid
from typing import Any

from fastapi.responses import JSONResponse
from starlette._utils import get_route_path

from tengyun.entrypoints.openai.protocol import error_body

API_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/invocations", "/tokenizer_info",
                "/pooling", "/classify", "/score", "/rerank", "/v2/rerank")  # the last five: pooling_routes.py
DOC_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
BODY_METHODS = ("POST", "PUT", "PATCH")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations")  # what GET /load counts


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


class RequestTooLarge(Exception):
    """A body without Content-Length grew past --max-request-bytes while it was read: a 413."""

    def __init__(self, limit: int):
        super().__init__(too_large_message(None, limit))


def too_large_message(size: int | None, limit: int) -> str:
    has = f"has {size:,} bytes" if size is not None else "is larger than that"
    return (f"The request body {has}; this server accepts at most {limit:,} bytes (--max-request-bytes, "
            f"sized from --max-model-len): shorten the prompt or raise --max-request-bytes.")


class GateMiddleware:
    def __init__(self, app: Any, host: Any):
        self.app = app
        self.host = host  # EngineHost: server.required_api_key, limits, frontend, lifecycle

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        host, lifecycle = self.host, self.host.lifecycle
        if host.frontend.enable_request_id_headers:
            send = _with_request_id(scope, send)
        path = route_path(scope)
        is_api = path.startswith(API_PREFIXES) or path == "/v1"
        if (is_api or path in DOC_PATHS) and host.server.required_api_key and not self._authorized(scope):
            response = error_response(401, "Invalid or missing API key: send it as 'Authorization: Bearer KEY'.")
            return await response(scope, receive, send)
        if not is_api:
            return await self.app(scope, receive, send)
        limit = host.limits.max_request_bytes
        size = _content_length(scope)
        if scope["method"] in BODY_METHODS and size is not None and size > limit:
            # Refused from the header alone: none of the body is read or kept.
            return await error_response(413, too_large_message(size, limit))(scope, receive, send)
        reason = lifecycle.unavailable_reason()
        if reason is not None:
            return await error_response(503, reason)(scope, receive, send)
        generating = path in GENERATION_PATHS
        lifecycle.in_flight += 1
        lifecycle.generating += generating
        try:
            await self.app(scope, _counting(receive, limit) if size is None else receive, send)
        finally:
            lifecycle.in_flight -= 1
            lifecycle.generating -= generating

    def _authorized(self, scope) -> bool:
        return bearer_matches(scope, self.host.server.required_api_key)


def bearer_matches(scope, key: str) -> bool:
    """Whether the request carries 'Authorization: Bearer <key>' (node 0 and --headless nodes)."""
    value = dict(scope.get("headers") or []).get(b"authorization", b"")
    scheme, _, token = value.partition(b" ")
    # Bytes: compare_digest refuses non-ASCII str, and a header may hold anything.
    return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), key.encode())


def route_path(scope) -> str:
    """The path the routes match: under --root-path, /prefix/v1/models and /v1/models (a proxy
    that strips the prefix) both reach /v1/models. Starlette's own function, so auth judges
    exactly the path routing does."""
    return get_route_path(scope)


def _with_request_id(scope, send):
    """--enable-request-id-headers: every answer carries X-Request-Id, the client's own or a new one."""
    given = dict(scope.get("headers") or []).get(b"x-request-id")
    request_id = given if given else uuid.uuid4().hex.encode()

    async def sending(message):
        if message["type"] == "http.response.start":
            headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
            message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
        await send(message)

    return sending


def _content_length(scope) -> int | None:
    value = dict(scope.get("headers") or []).get(b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None  # uvicorn refuses a malformed length before we get here


def _counting(receive, limit: int):
    """receive() for a chunked body: raises RequestTooLarge once more than `limit` bytes arrived."""
    received = 0

    async def counted():
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise RequestTooLarge(limit)
        return message

    return counted


class ResponseCounter:
    """Counts HTTP responses by status class ("2xx", "5xx", ...) on ``counter`` (a labelled
    prometheus Counter); an exception no handler inside turned into a response counts as 5xx
    (the outermost error handler answers it with a 500)."""

    def __init__(self, app: Any, counter: Any):
        self.app = app
        self.counter = counter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counting_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                self.counter.labels(status=f"{message['status'] // 100}xx").inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:
                self.counter.labels(status="5xx").inc()
            raise
