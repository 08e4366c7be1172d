"""The base of every request model: values of the declared JSON types only, text that is
Unicode, and RequestError, the 400 that names the field."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

logger = logging.getLogger("tengyun.server")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    # Unknown fields are ignored, as vLLM and OpenAI do; NaN / Infinity numbers are refused.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RequestModel(OpenAIBaseModel):
    """A piece of a request body: values must have the declared JSON types ("stream": "yes",
    "n": "2" or "max_tokens": 1.5 are refused, not coerced)."""

    model_config = ConfigDict(strict=True)


class RequestBody(RequestModel):
    """A whole request body: also refused when any string in it is not Unicode text."""

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any) -> Any:
        path = lone_surrogate_path(data)
        if path is not None:
            where = ".".join(path) or "the body"
            raise ValueError(f"{where} holds a lone UTF-16 surrogate (such as \\ud800), which is not text: "
                             f"send valid Unicode.")
        if isinstance(data, dict):
            ignored = sorted(repr(key) for key in data if key not in cls.model_fields)  # repr: one log line
            if ignored:  # as OpenAI and vLLM: unknown fields do not fail a request, but they are not silent
                logger.warning("%s: ignored the unknown field(s) %s", cls.__name__, ", ".join(ignored)[:300])
        return data


def lone_surrogate_path(data: Any) -> list[str] | None:
    """The path (["messages", "0", "content"]) of the first string, key or value, that cannot be
    UTF-8 encoded; None when all can. Iterative: a deeply nested body cannot exhaust the stack."""
    stack: list[tuple[Any, list[str]]] = [(data, [])]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                name = key.encode("utf-8", "backslashreplace").decode() if isinstance(key, str) else str(key)
                if isinstance(key, str) and not _is_unicode(key):
                    return [*path, name]
                stack.append((item, [*path, name]))
        elif isinstance(value, list):
            stack.extend((item, [*path, str(i)]) for i, item in enumerate(value))
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class RequestError(ValueError):
    """Bad request input: becomes a 400 (or `status`) with `param` set to the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status
