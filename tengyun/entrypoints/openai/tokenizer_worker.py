"""The front end's tokenizer, used off the event loop: chat templates render and prompts encode
in one worker thread, so /health and streaming answers never wait on them, and each template
render stops at a time limit.

One thread, one call at a time: a fast tokenizer is not safe to share between threads, and the
work per call is bounded (the body size limit bounds the text, the time limit the template).
"""

from __future__ import annotations

import asyncio
import functools
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from tengyun.entrypoints.openai.request_model import RequestError

TEMPLATE_FILENAME = "<template>"  # the filename jinja gives the Python code it compiles a template into


class RenderTimeout(Exception):
    """A chat template ran past its time limit."""


class TokenizerWorker:
    def __init__(self, tokenizer: Any, template_timeout_s: float):
        self.tokenizer = tokenizer
        self.template_timeout_s = template_timeout_s
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tengyun-tokenizer")

    async def run(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def require_tokenizer(self, param: str) -> Any:
        """The tokenizer; a 400 naming ``param`` when the server runs without one (--skip-tokenizer-init)."""
        if self.tokenizer is None:
            raise RequestError(f"This server runs with --skip-tokenizer-init: it has no tokenizer, so {param} "
                               f"cannot be text (send the prompt as token ids to /v1/completions), nor can it "
                               f"render chat templates. Unable to get tokenizer because skip_tokenizer_init is True.",
                               param)
        return self.tokenizer

    async def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        return await self.run(self.require_tokenizer(param).encode, text, add_special_tokens=add_special_tokens)

    async def apply_chat_template(self, conversation: list[dict], **kwargs: Any) -> str:
        """tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs); RenderTimeout
        once the template's own code has run template_timeout_s."""
        tokenizer = self.require_tokenizer("messages")
        render = functools.partial(tokenizer.apply_chat_template, conversation, tokenize=False, **kwargs)
        return await self.run(call_with_template_deadline, render, self.template_timeout_s)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def call_with_template_deadline(fn: Callable[[], Any], timeout_s: float) -> Any:
    """fn(), raising RenderTimeout inside any jinja template code still running timeout_s after
    the start. Only frames of compiled templates are traced (a check per template line), so the
    tokenizer's own Python runs untraced; a template's loops, however nested, hit the check."""
    deadline = time.monotonic() + timeout_s

    def in_template(frame, event: str, arg: Any):
        if time.monotonic() > deadline:
            raise RenderTimeout(f"the chat template ran longer than {timeout_s:g} s")
        return in_template

    def on_call(frame, event: str, arg: Any):
        return in_template if frame.f_code.co_filename == TEMPLATE_FILENAME else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return fn()
    finally:
        sys.settrace(previous)
