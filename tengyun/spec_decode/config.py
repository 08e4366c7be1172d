"""SpeculativeConfig: vLLM's --speculative-config JSON, checked and with its defaults filled in."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

FLAG = "--speculative-config"
METHODS = ("ngram", "mtp")
# vLLM's ngram default when neither bound is given: match exactly 5-token suffixes.
DEFAULT_PROMPT_LOOKUP = 5
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 3}'


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" (prompt lookup, any model) or "mtp" (the model's multi-token-prediction layers)
    num_speculative_tokens: int  # K >= 1 drafts verified per target step
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP  # ngram: shortest suffix matched
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP  # ngram: longest suffix matched (tried first)

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """None / "" -> None; a JSON string or dict with vLLM's keys -> a checked config.
        Raises ValueError naming --speculative-config and the key to change."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{FLAG} must be a JSON object such as '{_EXAMPLE}'; got {value!r} ({e}).") from None
        if not isinstance(value, dict):
            raise ValueError(f"{FLAG} must be a JSON object such as '{_EXAMPLE}'; got {value!r}.")
        return cls._from_dict(value)

    @classmethod
    def _from_dict(cls, value: dict[str, Any]) -> "SpeculativeConfig":
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"{FLAG} has keys Tengyun does not know: {unknown}; it takes {list(_KEYS)}.")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"{FLAG} method must be one of {', '.join(METHODS)}; got {method!r}.")
        k = value.get("num_speculative_tokens")
        if not _is_int(k) or k < 1:
            raise ValueError(f"{FLAG} num_speculative_tokens must be an integer >= 1 (try 3); got {k!r}.")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if method != "ngram":
            if low is not None or high is not None:
                raise ValueError(f"{FLAG} prompt_lookup_min / prompt_lookup_max apply to method ngram only; "
                                 f"drop them for method {method!r}.")
            return cls(method, k)
        low, high = _lookup_bounds(low, high)
        return cls(method, k, low, high)

    def to_json(self) -> str:
        """The flag's value that parses back to this config."""
        keys = _KEYS if self.method == "ngram" else _KEYS[:2]
        return json.dumps({key: getattr(self, key) for key in keys})


def _lookup_bounds(low: Any, high: Any) -> tuple[int, int]:
    """vLLM's rule: neither given -> (5, 5); one given -> both that value; then 1 <= min <= max."""
    if low is None and high is None:
        low = high = DEFAULT_PROMPT_LOOKUP
    elif low is None:
        low = high
    elif high is None:
        high = low
    for key, v in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        if not _is_int(v) or v < 1:
            raise ValueError(f"{FLAG} {key} must be an integer >= 1 (try 2); got {v!r}.")
    if low > high:
        raise ValueError(f"{FLAG} prompt_lookup_min {low} is above prompt_lookup_max {high}: "
                         f"lower prompt_lookup_min to at most {high}.")
    return low, high


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
