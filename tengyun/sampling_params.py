"""Per-request sampling settings, named and validated as in vLLM's SamplingParams."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request carries (vLLM's names and values).

    Over a 3-token answer "a", "b", "c" (outputs after each step):
        CUMULATIVE  [a] [a, b] [a, b, c]   everything so far: O(length) a step, O(length^2) in all
        DELTA       [a] [b] [c]            only what is new; prompt_logprobs in the first output only
        FINAL_ONLY  [a, b, c]              one output, when the request finished
    Concatenating a sequence's DELTA token ids, text and logprobs gives the CUMULATIVE ones.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's names); exactly one of the first six fields is set.

    Pure data: the worker compiles it with xgrammar (tengyun/structured_output.py) and masks
    the logits of the constrained rows each step.
    """

    json: str | dict | None = None  # a JSON schema (text or dict)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF-style, as xgrammar reads it)
    json_object: bool | None = None  # any JSON object
    structural_tag: str | None = None  # xgrammar's structural tag, as JSON text (forced tool calls use it)
    # True (our default): JSON is laid out as `{"a": 1, "b": [2, 3]}`, so a small model cannot
    # spend its tokens on whitespace; False allows any whitespace between JSON tokens.
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        kinds = [name for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                 if getattr(self, name) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object, structural_tag; got {kinds or 'none'}.")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r}.")

    @property
    def kind(self) -> str:
        """'json', 'regex', 'choice', 'grammar', 'json_object' or 'structural_tag'."""
        return next(name for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                    if getattr(self, name) not in (None, False))


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per output token; -1: the whole vocabulary
    # Per prompt token after the first: its logprob, rank and the top-N (raw logits, as vLLM); -1: all.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding
    # {token id: bias} added to the logits before penalties and filters (OpenAI's field; the
    # server clamps values to [-100, 100] as vLLM does). {"42": 1} becomes {42: 1}; {} becomes None.
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Outputs while the request runs (CUMULATIVE, DELTA): the first, then one each time a sequence
    # has this many new tokens or finishes, and the last. None: the engine's --stream-interval;
    # a smaller value is raised to it (vLLM's stream_interval).
    stream_interval: int | None = None
    # Filled by the engine, never by users: EOS ids of the model.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = _token_id_keys(self.logit_bias) or None
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, value, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {value!r}.")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, value, "a finite number")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if self.temperature < 0.0:
            raise bad("temperature", self.temperature, ">= 0 (use 0 for greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "> 0 (1 disables it)")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < -1):
                raise bad(name, value, "an integer >= 0, or -1 for the whole vocabulary")
        if self.logit_bias and not all(isinstance(b, (int, float)) and math.isfinite(b)
                                       for b in self.logit_bias.values()):
            raise bad("logit_bias", self.logit_bias, "a map of token ids to finite numbers")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an integer")
        if self.stream_interval is not None and (type(self.stream_interval) is not int or self.stream_interval < 1):
            raise bad("stream_interval", self.stream_interval, "an integer >= 1")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", self.output_kind, "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")

    def check_against_model(self, max_logprobs: int, vocab_size: int) -> None:
        """What needs the engine's settings: logprob counts within --max-logprobs, logit_bias ids
        within the vocabulary. Raises ValueError naming the field."""
        check_num_logprobs("logprobs", self.logprobs, max_logprobs, vocab_size)
        check_num_logprobs("prompt_logprobs", self.prompt_logprobs, max_logprobs, vocab_size)
        check_logit_bias(self.logit_bias, vocab_size)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _token_id_keys(logit_bias: dict | None) -> dict[int, float]:
    """{"42": 1, 7: -2} -> {42: 1, 7: -2}; a key that is no integer is a ValueError naming logit_bias."""
    if logit_bias is not None and not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a map of token ids to biases, got {logit_bias!r}.")
    result = {}
    for key, bias in (logit_bias or {}).items():
        try:
            if isinstance(key, (bool, float)):
                raise ValueError
            result[int(key)] = bias
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids (integers, or their decimal strings "
                             f"such as \"42\"), got {key!r}.") from None
    return result


def check_num_logprobs(name: str, count: int | None, max_logprobs: int, vocab_size: int) -> None:
    """As vLLM: -1 means the whole vocabulary, on either side.

    max_logprobs 20: count 20 passes, 21 or -1 fails; max_logprobs -1: any count, -1 included.
    """
    if count is None:
        return
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    asked = vocab_size if count == -1 else count
    if asked > limit:
        whole = f" (-1: the whole vocabulary of {vocab_size})" if count == -1 else ""
        raise ValueError(f"{name} asks for {count}{whole} but --max-logprobs is {max_logprobs}: ask for at most "
                         f"{limit}, or raise --max-logprobs to {asked} (-1 allows the whole vocabulary).")


def check_logit_bias(logit_bias: dict[int, float] | None, vocab_size: int) -> None:
    bad = sorted(t for t in (logit_bias or {}) if not 0 <= t < vocab_size)
    if bad:
        raise ValueError(f"logit_bias holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}.")
