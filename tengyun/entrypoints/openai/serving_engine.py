"""OpenAIServing: what the completion and chat handlers share — model check, tokenizing and
length checks, SSE framing, and merging the streams of several engine requests."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator

from tengyun.engine.async_engine import AsyncLLMEngine, EngineDeadError
from tengyun.entrypoints.openai.protocol import (
    ChatMessage, PromptTokenUsageInfo, RequestError, UsageInfo, error_body,
)
from tengyun.entrypoints.openai.request_model import random_id
from tengyun.entrypoints.openai.request_limits import RequestLimits
from tengyun.entrypoints.openai.serving_models import ServingModels
from tengyun.entrypoints.openai.tokenizer_worker import RenderTimeout, TokenizerWorker
from tengyun.entrypoints.openai.vllm_args import FrontendOptions
from tengyun.lora.request import LoRARequest
from tengyun.outputs import CompletionOutput, RequestOutput
from tengyun.sampling_params import SamplingParams, StructuredOutputsParams, check_logit_bias, check_num_logprobs

logger = logging.getLogger("tengyun.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, worker: TokenizerWorker | None, served_model_name: str,
                 chat_template: str | None = None, sampling_defaults: dict[str, Any] | None = None,
                 limits: RequestLimits | None = None, frontend: FrontendOptions | None = None,
                 models: ServingModels | None = None):
        self.engine = engine
        self.worker = worker  # the front end's tokenizer, off the event loop (the engine thread has another)
        self.tokenizer = worker.tokenizer if worker is not None else None  # for short decodes on the loop
        self.served_model_name = served_model_name
        self.max_model_len = engine.config.max_model_len
        self.vocab_size = engine.config.model_spec.vocab_size
        self.max_logprobs = engine.config.max_logprobs
        self.chat_template = chat_template
        # --generation-config: {"temperature": 0.7, "max_tokens": 512, ...} for fields a request leaves unset
        self.sampling_defaults = sampling_defaults or {}
        self.limits = limits or RequestLimits()
        self.frontend = frontend or FrontendOptions()
        self.models = models  # the LoRA adapters a request's "model" may name; None: the base model only

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        """Token counts of an answer; prompt_tokens_details with --enable-prompt-tokens-details when
        the prefix cache served some of the prompt (vLLM leaves it out otherwise)."""
        details = PromptTokenUsageInfo(cached_tokens=cached_tokens) \
            if self.frontend.enable_prompt_tokens_details and cached_tokens else None
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)

    def tokens_as_ids(self, request: Any) -> bool:
        """return_tokens_as_token_ids: the request's own value, else --return-tokens-as-token-ids;
        always without a tokenizer (--skip-tokenizer-init), which leaves tokens no text."""
        if self.tokenizer is None:
            return True
        own = request.return_tokens_as_token_ids
        return self.frontend.return_tokens_as_token_ids if own is None else own

    def truncate_prompt(self, token_ids: list[int], keep: int | None) -> list[int]:
        """truncate_prompt_tokens: the prompt's last `keep` tokens (-1: --max-model-len of them), as vLLM."""
        if keep is None:
            return token_ids
        if keep > self.max_model_len:
            raise RequestError(f"truncate_prompt_tokens is {keep} but --max-model-len is {self.max_model_len}: "
                               f"keep at most {self.max_model_len} tokens.", "truncate_prompt_tokens")
        return token_ids[-(self.max_model_len if keep == -1 else keep):]

    @staticmethod
    def response_id(prefix: str, request: Any) -> str:
        """"cmpl-<request_id>" when the request names itself (vLLM's request_id field), else random."""
        return f"{prefix}-{request.request_id}" if request.request_id else random_id(prefix)

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` names (None: the base model); 404 for a name not served."""
        if self.models is not None:
            return self.models.lora_for(model)
        if model is not None and model != self.served_model_name:
            raise RequestError(f"The model `{model}` does not exist; this server serves "
                               f"`{self.served_model_name}`.", "model", status=404)  # as vLLM answers

    def response_name(self, model: str | None) -> str:
        """The "model" an answer carries: the adapter the request named, else the served model."""
        return self.served_model_name if self.models is None else self.models.response_name(model)

    # ----- prompts ----------------------------------------------------------------------
    async def tokenize_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return await self.worker.encode(prompt, add_special_tokens)
        if len(prompt) < self.max_model_len:  # a longer one is refused by check_length, ids unread
            self.check_token_ids(prompt, "prompt")
        return list(prompt)

    def text_of(self, token_ids: list[int]) -> str:
        """The ids' text; "" without a tokenizer (--skip-tokenizer-init), as vLLM echoes then."""
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)

    def detokenize(self, token_ids: list[int]) -> str:
        """/detokenize, in the tokenizer thread: the ids' text; a 400 naming the ids out of range."""
        self.check_token_ids(token_ids, "tokens")
        return self.worker.require_tokenizer("tokens").decode(token_ids)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"{param} holds token ids out of vocabulary (outside [0, {self.vocab_size})): "
                               f"{bad[:5]}.", param)

    def check_against_model(self, params: SamplingParams, logprobs_field: str) -> None:
        """The engine's checks (logprob counts within --max-logprobs, logit_bias ids within the
        vocabulary), made here so the 400 names the request's field: `logprobs_field` is what
        the request called SamplingParams.logprobs (chat: top_logprobs)."""
        for name, count in ((logprobs_field, params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            try:
                check_num_logprobs(name, count, self.max_logprobs, self.vocab_size)
            except ValueError as e:
                raise RequestError(str(e), name) from None
        try:
            check_logit_bias(params.logit_bias, self.vocab_size)
        except ValueError as e:
            raise RequestError(str(e), "logit_bias") from None

    async def check_structured_outputs(self, spec: StructuredOutputsParams | None, param: str | None) -> None:
        """Compile the request's grammar off the event loop (cached for the worker): a bad schema,
        regex or grammar is a 400 naming the field, before anything is queued."""
        if spec is None:
            return
        from tengyun.structured_output import grammar_compiler_for_config

        try:
            await asyncio.to_thread(lambda: grammar_compiler_for_config(self.engine.config).compile(spec))
        except ValueError as e:
            raise RequestError(f"{param}: {e}" if param else str(e), param) from None

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          continue_final_message: bool = False, chat_template: str | None = None,
                          chat_template_kwargs: dict[str, Any] | None = None,
                          tools: list[dict[str, Any]] | None = None) -> str:
        """The tokenizer's chat template (or --chat-template / the request's) over the messages,
        rendered in the tokenizer thread under --chat-template-timeout."""
        self.check_request_template(chat_template, chat_template_kwargs)
        template = chat_template or self.chat_template
        self.worker.require_tokenizer("messages")
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("The model has no chat template: start the server with --chat-template "
                               "or use /v1/completions.", "messages")
        conversation = [_message_dict(m) for m in messages]
        try:
            return await self.worker.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=template, tools=tools,
                **(chat_template_kwargs or {}),
            )
        except RenderTimeout as e:
            raise RequestError(f"The chat template did not finish: {e} (--chat-template-timeout).",
                               "chat_template" if chat_template else "messages") from None
        except Exception as e:  # jinja errors, raise_exception() in templates, bad kwargs
            raise RequestError(f"The chat template failed on these messages: {e}", "messages") from None

    def check_request_template(self, chat_template: str | None, kwargs: dict[str, Any] | None) -> None:
        """A template is code: a request may bring one only where the operator allowed it (as vLLM)."""
        if self.limits.trust_request_chat_template:
            return
        field = "chat_template" if chat_template is not None else (
            "chat_template_kwargs.chat_template" if kwargs and "chat_template" in kwargs else None)
        if field is not None:
            raise RequestError(f"{field}: this server does not accept chat templates in requests; drop the "
                               f"field, or start the server with --trust-request-chat-template.", field.split(".")[0])

    def default_max_tokens(self, num_prompt_tokens: int, fallback: int | None) -> int | None:
        """max_tokens for a request that left it unset: --generation-config's max_new_tokens, cut to
        the room --max-model-len leaves (a default the client never sent must not fail its request);
        without one, `fallback` (16 for completions, None = up to --max-model-len for chat)."""
        default = self.sampling_defaults.get("max_tokens")
        if default is None:
            return fallback
        room = self.max_model_len - num_prompt_tokens
        return min(default, room) if room > 0 else None

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, what: str = "prompt") -> None:
        """Prompt + max_tokens must fit --max-model-len; the message carries both numbers."""
        if num_prompt_tokens == 0:
            raise RequestError(f"The decoder prompt cannot be empty: the {what} holds no tokens.",  # vLLM's words
                               "messages" if what == "messages" else "prompt")
        limit = self.max_model_len
        if max_tokens is None:
            if num_prompt_tokens >= limit:
                raise RequestError(
                    f"This model's maximum context length is {limit} tokens, but the {what} has "
                    f"{num_prompt_tokens} tokens, which leaves no room to generate: shorten it below "
                    f"{limit} tokens or raise --max-model-len.", "messages" if what == "messages" else "prompt")
        elif num_prompt_tokens + max_tokens > limit:
            room = limit - num_prompt_tokens
            fix = f"lower max_tokens to {room}" if room > 0 else f"shorten the {what}"
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {what}, "
                f"{max_tokens} in the completion): {fix} or raise --max-model-len.", "max_tokens")

    # ----- streams ----------------------------------------------------------------------
    async def merged(self, streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Interleave several engine streams as (stream index, output); closing this closes all."""
        if len(streams) == 1:
            try:
                async for output in streams[0]:
                    yield 0, output
            finally:
                await streams[0].aclose()  # an early exit aborts the engine request
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for output in stream:
                    await queue.put((i, output))
            except Exception as e:
                await queue.put((i, e))
            await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()  # cancelling a pump closes its engine stream, which aborts the request
            await asyncio.gather(*tasks, return_exceptions=True)


class StreamedChoice:
    """One choice of a stream, fed the engine's DELTA outputs: the tokens (and logprobs) received
    but not sent yet (in chat a step whose text is held back sends nothing), and counts so far."""

    def __init__(self) -> None:
        self.num_tokens = 0  # received
        self.num_sent_tokens = 0
        self.num_sent_chars = 0  # of the completion's text, echo excluded
        self.started = False  # its first chunk went out
        self.done = False  # its finish_reason went out
        self._unsent_ids: list[int] = []
        self._unsent_logprobs: list[dict] = []

    def receive(self, c: CompletionOutput) -> None:
        self.num_tokens += len(c.token_ids)
        self._unsent_ids.extend(c.token_ids)
        self._unsent_logprobs.extend(c.logprobs or [])

    @property
    def has_unsent_tokens(self) -> bool:
        return bool(self._unsent_ids)

    def take(self) -> tuple[list[int], list[dict]]:
        """(token ids, their logprobs, empty without logprobs) not sent yet; sent from now on."""
        ids, logprobs = self._unsent_ids, self._unsent_logprobs
        self._unsent_ids, self._unsent_logprobs = [], []
        self.num_sent_tokens += len(ids)
        return ids, logprobs


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    """Text parts joined with newlines: templates expect string content."""
    data = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"Only text content parts are supported, got type {part.get('type')!r}.",
                                   "messages")
            texts.append(part["text"])
        data["content"] = "\n".join(texts)
    for call in data.get("tool_calls") or []:
        # Templates write arguments with tojson / items(): give them the object, not its JSON text.
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass
    return data


def token_text(token_id: int, decoded: str | None, as_ids: bool) -> str:
    """A logprob entry's token: its text, or "token_id:42" with return_tokens_as_token_ids (vLLM's
    form, for tokens that are not whole characters on their own)."""
    return f"token_id:{token_id}" if as_ids else decoded or ""


def sampled_then_ranked(entry: dict[int, Any], token_id: int) -> list[tuple[int, Any]]:
    """A step's logprobs in vLLM's order: the sampled token first, then the others by rank.
    {9: rank 3 (sampled), 4: rank 1, 7: rank 2} -> [9, 4, 7]."""
    others = sorted((item for item in entry.items() if item[0] != token_id), key=lambda item: item[1].rank or 0)
    return [(token_id, entry[token_id]), *others]


# Characters str.splitlines() breaks lines at (as httpx's iter_lines does), escaped inside the JSON
# so a client splitting that way still gets whole events; SSE itself splits only at \r and \n.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: Any) -> str:
    """One server-sent event: `data: {...}\\n\\n`, the JSON on one line for any line splitter."""
    body = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)
    return f"data: {body}\n\n"


def sse_model(model: Any, exclude: set[str] | None = None) -> str:
    """One server-sent event of a pydantic response: its compact JSON from pydantic's own encoder
    (as vLLM sends chunks): ~0.6x the time of model_dump + json.dumps per chunk
    (benchmarks/sse_chunk_encoding.py)."""
    return f"data: {model.model_dump_json(exclude=exclude).translate(_LINE_BREAKS)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def error_status(e: Exception) -> int:
    """HTTP status for an exception: bad input 400, dead engine 503, anything else 500."""
    if isinstance(e, EngineDeadError):
        return 503
    return 400 if isinstance(e, ValueError) else 500


INTERNAL_ERROR_MESSAGE = "Internal server error; the server log has the details."


def public_message(e: Exception) -> str:
    """What a client may read of an exception: bad input and a dead engine say why; anything
    else is our bug, and its text (paths, types, internals) stays in the server log."""
    return INTERNAL_ERROR_MESSAGE if error_status(e) == 500 else str(e)


def sse_error(e: Exception) -> str:
    """An error after the stream started: headers are gone, so it travels in-band."""
    if error_status(e) == 500:
        logger.error("Internal error in a stream", exc_info=e)
    return sse(error_body(error_status(e), public_message(e), getattr(e, "param", None)))
