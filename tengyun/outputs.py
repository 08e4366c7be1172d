"""What the engine returns: vLLM-shaped RequestOutput / CompletionOutput."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    """One-to-one with OpenAI's ``finish_reason``."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by the caller (client gone, shutdown)

    def __str__(self) -> str:
        return self.value


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# One entry per generated token: {token_id: Logprob} holding the sampled token and the top-k.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing predicts it), then {token_id: Logprob}
# holding the actual prompt token (with its rank) and the top-N.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    max_tokens: int | None = None  # as resolved: the request's, capped at max_model_len - prompt length


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # only when SamplingParams.prompt_logprobs is set


@dataclass
class RequestProgress:
    """Where one request stands after a step that changed it, whatever its output kind: what the
    metrics listeners read (a FINAL_ONLY request has no RequestOutput until it finishes)."""

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: list[int]  # per sequence, in index order: tokens generated so far
    finish_reasons: list[str | None]  # per sequence; None while it runs
    finished: bool
    metrics: RequestMetrics  # a snapshot taken after the step
