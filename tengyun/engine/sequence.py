"""Sequence: one generated completion (a request with n=2 owns two), tracked in tokens."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tengyun.lora.request import LoRARequest
from tengyun.outputs import FinishReason, SampleLogprobs
from tengyun.pooling_params import PoolingParams
from tengyun.prompt_embeds import PromptEmbeds
from tengyun.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"  # a beam that reported its round: blocks kept for the beams forked from it
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token state of one completion.

    Invariant: 0 <= num_computed_tokens <= num_tokens. Tokens [0, num_computed_tokens) have
    KV in the blocks of ``block_table``; the scheduler picks how many of the rest to compute
    next. There is no prefill/decode phase: a decode step is computing the one last token.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_order: int
    # Round-robin admission between API requests: 0 for a request's first sequence, k for its
    # (k+1)-th (n copies and several prompts of one request count together). See Scheduler.add.
    turn: int = 0
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first schedule
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of the full blocks, in order
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    output_logprobs: SampleLogprobs = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    # Speculative decoding: drafts scheduled after the last token this step (their KV is written,
    # and kept only for the drafts the target accepts; see Scheduler.advance).
    spec_token_ids: list[int] = field(default_factory=list)
    # Drafts the worker's draft model (mtp) proposed after the last step, for the next one.
    proposed_token_ids: list[int] = field(default_factory=list)
    # The LoRA adapter it runs with (tengyun/lora/request.py LoRARequest); None: the base model.
    lora_request: LoRARequest | None = None
    # A pooling request's (resolved): prefill only, finished by the step that computes its last token.
    pooling_params: PoolingParams | None = None
    # An embeddings prompt (--enable-prompt-embeds): prompt_token_ids are its placeholders; the
    # worker embeds only the outputs. Its blocks are neither looked up nor cached (prompt_embeds.py).
    prompt_embeds: PromptEmbeds | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def uses_prefix_cache(self) -> bool:
        """False for prompt logprobs (as vLLM): a cached block's positions produce no logits; nor
        for a pooling request that pools every row (MEAN, CLS, ALL); nor for embeddings prompts,
        whose placeholder ids say nothing of their KV (as vLLM)."""
        if self.prompt_embeds is not None:
            return False
        if self.pooling_params is not None and not self.pooling_params.uses_prefix_cache:
            return False
        return self.sampling_params.prompt_logprobs is None

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
