"""GateMiddleware: what every API request passes before a route sees it, in this order:
bearer auth (401), body size (413), readiness / draining (503), then in-flight counting.

Route classes:
    /v1/*, /tokenize, /detokenize     all of it
    /docs, /redoc, /openapi.json      the key, when --api-key is set (they describe the API)
    /health, /metrics, /version       open: probes and scrapers carry no key
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi.responses import JSONResponse

from tengyun.entrypoints.openai.protocol import error_body

API_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
DOC_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
BODY_METHODS = ("POST", "PUT", "PATCH")


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
    def __init__(self, app: Any, state: Any):
        self.app = app
        self.state = state  # ServerState: api_key, limits, unavailable_reason(), in_flight

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        is_api = path.startswith(API_PREFIXES) or path == "/v1"
        state = self.state
        if (is_api or path in DOC_PATHS) and state.api_key and not self._authorized(scope):
            response = error_response(401, "Invalid or missing API key: send it as 'Authorization: Bearer KEY'.")
            return await response(scope, receive, send)
        if not is_api:
            return await self.app(scope, receive, send)
        limit = state.limits.max_request_bytes
        size = _content_length(scope)
        if scope["method"] in BODY_METHODS and size is not None and size > limit:
            # Refused from the header alone: none of the body is read or kept.
            return await error_response(413, too_large_message(size, limit))(scope, receive, send)
        reason = state.unavailable_reason()
        if reason is not None:
            return await error_response(503, reason)(scope, receive, send)
        state.in_flight += 1
        try:
            await self.app(scope, _counting(receive, limit) if size is None else receive, send)
        finally:
            state.in_flight -= 1

    def _authorized(self, scope) -> bool:
        value = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = value.partition(b" ")
        # Bytes: compare_digest refuses non-ASCII str, and a header may hold anything.
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.state.api_key.encode())


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
