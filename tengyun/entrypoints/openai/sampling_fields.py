"""SamplingFields: what the completion and chat requests share (OpenAI's sampling fields, then
vLLM's extras) and how they become SamplingParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tengyun.entrypoints.openai.request_model import RequestBody, RequestError, RequestModel
from tengyun.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
UNSUPPORTED = {  # field -> why it is refused
    "allowed_token_ids": "allowed_token_ids is not supported; use logit_bias or a guided_choice / guided_regex "
                         "constraint instead.",
    "bad_words": "bad_words is not supported; use logit_bias with -100 on the words' tokens instead.",
    "priority": "priority scheduling is not supported: requests take turns in arrival order; drop priority.",
    "cache_salt": "cache_salt (per-tenant prefix cache isolation) is not supported; drop it.",
    "logits_processors": "custom logits processors are not supported; drop logits_processors.",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported; drop it.",
    "kv_transfer_params": "disaggregated prefill (KV transfer) is not supported; drop kv_transfer_params.",
    "vllm_xargs": "vllm_xargs (arguments for vLLM plugins) is not supported; drop it.",
}


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, usage on every chunk too


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(RequestBody):
    """Sampling fields shared by both endpoints: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # {"42": 5.0}: token id -> bias, clamped to [-100, 100]
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:N"; default the server flag
    # answered as `prompt_logprobs`, vLLM's shape; not when streaming. Read as vLLM's lax model reads
    # it: true is 1, "3" is 3 (vLLM's own tests send "prompt_logprobs": true)
    prompt_logprobs: int | None = Field(None, strict=False)
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and older guided_*.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM extras that work here
    return_token_ids: bool | None = False  # token_ids per choice and prompt_token_ids in the answer
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: --max-model-len)
    request_id: str | None = None  # the answer's id is built from it (else from a random one)
    stream_interval: int | None = None  # tokens a streamed chunk carries, raised to --stream-interval
    # Beam search (serving_beam_search.py): n beams; length_penalty and early_stopping apply to it only
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False  # not in vLLM 0.11 (V0 had it); see beam_search.py
    # vLLM extras Tengyun does not do: refused (400) when set to anything but their default
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = 0
    cache_salt: str | None = None
    logits_processors: list[Any] | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        """Field validators, so the 400's `param` names the field."""
        if value != cls.model_fields[info.field_name].default:
            raise ValueError(UNSUPPORTED[info.field_name])
        return value

    @field_validator("guided_decoding_backend")
    @classmethod
    def _xgrammar_only(cls, value: str | None) -> str | None:
        if value not in (None, "auto", "xgrammar"):
            raise ValueError(f'this server decodes with xgrammar: send "xgrammar", "auto" or nothing, not {value!r}.')
        return value

    @field_validator("seed")
    @classmethod
    def _seed_is_int64(cls, value: int | None) -> int | None:
        if value is not None and not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"seed must be a 64-bit integer, between {INT64_MIN} and {INT64_MAX}; got {value}.")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation_size(cls, value: int | None) -> int | None:
        if value is not None and (value == 0 or value < -1):
            raise ValueError(f"truncate_prompt_tokens must be >= 1, or -1 for --max-model-len; got {value}.")
        return value

    @field_validator("length_penalty", "early_stopping")
    @classmethod
    def _beam_search_only(cls, value: Any, info: ValidationInfo) -> Any:
        """Declared after use_beam_search, so info.data holds it."""
        if not info.data.get("use_beam_search") and value != cls.model_fields[info.field_name].default:
            raise ValueError(f"{info.field_name} applies to beam search only: set use_beam_search to true, or "
                             f"drop {info.field_name}.")
        return value

    @model_validator(mode="after")
    def _check_common(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true.")
        if self.prompt_logprobs is not None:  # the most allowed is --max-logprobs, checked by OpenAIServing
            if self.prompt_logprobs < -1:
                raise ValueError(f"prompt_logprobs must be >= 0, or -1 for the whole vocabulary, "
                                 f"got {self.prompt_logprobs}.")
            if self.stream:
                raise ValueError("prompt_logprobs are not sent when streaming (as in vLLM): drop prompt_logprobs "
                                 "or stream.")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def usage_on_every_chunk(self) -> bool:
        return self.include_usage_in_stream and bool(self.stream_options.continuous_usage_stats)

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """(the request's output constraint, the field it came from); at most one field may set one."""
        given = {name: getattr(self, name) for name in
                 ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(self, name) is not None}
        if self.response_format is not None and self.response_format.type != "text":
            given["response_format"] = self.response_format
        if len(given) > 1:
            raise RequestError(f"Set at most one output constraint, got {sorted(given)}.", sorted(given)[1])
        if not given:
            return None, None
        (source, value), = given.items()
        try:
            if source == "response_format":
                if value.type == "json_object":
                    return StructuredOutputsParams(json_object=True), source
                if value.json_schema is None or value.json_schema.json_schema is None:
                    raise ValueError("response_format json_schema needs json_schema.schema.")
                return StructuredOutputsParams(json=value.json_schema.json_schema), source
            if source == "structured_outputs":
                return StructuredOutputsParams(**value), source
            return StructuredOutputsParams(**{source.removeprefix("guided_"): value}), source
        except (TypeError, ValueError) as e:
            raise RequestError(f"{source}: {e}", source) from None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         structured_outputs: StructuredOutputsParams | None = None,
                         prompt_logprobs: int | None = None,
                         defaults: dict[str, Any] | None = None) -> SamplingParams:
        """`defaults` (--generation-config) fill temperature, top_p, top_k, min_p and
        repetition_penalty where the request left them unset (null). A stream takes DELTA outputs
        (what each step added), an answer in one piece FINAL_ONLY (one output at the end)."""
        defaults = defaults or {}

        def pick(name: str, neutral: float) -> Any:
            value = getattr(self, name)
            return defaults.get(name, neutral) if value is None else value

        try:
            return SamplingParams(
                n=self.n,
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0),
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=pick("repetition_penalty", 1.0),
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                structured_outputs=structured_outputs,
                logit_bias={token: min(100.0, max(-100.0, bias)) for token, bias in (self.logit_bias or {}).items()},
                output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
                stream_interval=self.stream_interval,
            )
        except ValueError as e:  # SamplingParams names the field first: "top_p must be ..."
            field_name = str(e).split(" ", 1)[0]
            raise RequestError(str(e), field_name if field_name in type(self).model_fields else None) from None
