"""Routes vLLM serves beside the OpenAI ones: GET /load, GET /tokenizer_info (with
--enable-tokenizer-info-endpoint) and POST /invocations (SageMaker's single entry point: the
body's shape picks chat or completions, or on a pooling server one of the pooling routes)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from tengyun.entrypoints.openai.pooling_routes import pooling_invocation
from tengyun.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, RequestError
from tengyun.entrypoints.openai.responses import respond, until_disconnect

TOKENIZER_INFO_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "add_bos_token", "add_eos_token",
                       "clean_up_tokenization_spaces", "padding_side", "truncation_side")


def add_vllm_routes(app: FastAPI, host: Any) -> None:
    """``host``: the EngineHost the OpenAI routes call."""
    @app.get("/load")
    async def load() -> dict:
        """Generation requests in flight, counted with --enable-server-load-tracking (else 0, as vLLM)."""
        return {"server_load": host.lifecycle.generating if host.frontend.enable_server_load_tracking else 0}

    if host.frontend.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info() -> dict:
            return tokenizer_info_of(host.worker.tokenizer, host.server.chat_template_text,
                                     host.config.max_model_len)

    @app.post("/invocations")
    async def invocations(raw_request: Request):
        body = await _json_object(raw_request)
        if host.config.pooling is not None:
            work = pooling_invocation(host, body, _validated)
        elif "messages" in body:
            request = _validated(ChatCompletionRequest, body)
            work = host.chat.create_chat_completion(request)
        elif "prompt" in body:
            request = _validated(CompletionRequest, body)
            work = host.completion.create_completion(request)
        else:
            raise RequestError("/invocations takes a chat body (with messages) or a completions body (with "
                               "prompt).", "messages")
        return respond(await until_disconnect(raw_request, work))


def tokenizer_info_of(tokenizer: Any, chat_template: str | None, max_model_len: int) -> dict:
    """The tokenizer's class, special tokens and chat template; never a file path."""
    info = {"tokenizer_class": type(tokenizer).__name__,
            "chat_template": chat_template or getattr(tokenizer, "chat_template", None),
            "model_max_length": max_model_len}
    for key in TOKENIZER_INFO_KEYS:
        value = tokenizer.init_kwargs.get(key, getattr(tokenizer, key, None))
        if isinstance(value, (str, int, float, bool)):
            info[key] = value
        elif value is not None and hasattr(value, "content"):  # AddedToken
            info[key] = value.content
    return info


async def _json_object(raw_request: Request) -> dict:
    try:
        body = json.loads(await raw_request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    return body


def _validated(model: type, body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as e:  # the same 400 as the other routes' bodies
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
