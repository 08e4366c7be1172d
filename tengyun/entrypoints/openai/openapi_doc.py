"""The OpenAPI document as the server really answers: FastAPI declares 422 for a bad body, but
this server answers 400 in OpenAI's error shape; API routes may also answer 401 (--api-key),
413 (--max-request-bytes) and 503 (starting or draining). Fuzzers and client generators read it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from tengyun.entrypoints.openai.middleware import API_PREFIXES
from tengyun.entrypoints.openai.protocol import ErrorResponse

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
API_ERRORS = {
    "400": "Bad input: `error.param` names the field",
    "401": "Missing or wrong API key (only when the server runs with --api-key)",
    "503": "The server is starting, draining for shutdown, or its engine stopped",
}
BODY_ERRORS = {"404": "`model` names a model this server does not serve",
               "413": "The body is larger than --max-request-bytes"}
NOT_JSON = {  # routes whose 200 is not JSON
    "/health": {"description": "Ready: an empty body"},
    "/metrics": {"description": "Prometheus text format",
                 "content": {"text/plain": {"schema": {"type": "string"}}}},
}


def install_openapi(app: FastAPI, with_api_key: bool) -> None:
    """Replace app.openapi with one that builds the corrected document once."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = corrected_schema(app, with_api_key)
        return app.openapi_schema

    app.openapi = openapi


def corrected_schema(app: FastAPI, with_api_key: bool) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(error_schema.pop("$defs", {}))
    components["ErrorResponse"] = error_schema
    for path, operations in schema.get("paths", {}).items():
        is_api = path.startswith(API_PREFIXES)
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if path in NOT_JSON:
                responses["200"] = NOT_JSON[path]
            errors = dict(API_ERRORS) if is_api else {}
            if is_api and "requestBody" in operation:
                errors.update(BODY_ERRORS)
            if not with_api_key:
                errors.pop("401", None)
            if path == "/health":
                errors["503"] = API_ERRORS["503"]
            if path == "/health/detail":  # 503 carries the same JSON as 200, `reason` saying why
                responses["503"] = {"description": API_ERRORS["503"] + ": the same JSON, `reason` says why",
                                    "content": {"application/json": {"schema": {"type": "object"}}}}
            for status, description in errors.items():
                responses.setdefault(status, {"description": description,
                                              "content": {"application/json": {"schema": ERROR_REF}}})
    return schema
