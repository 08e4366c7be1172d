"""Scheduler -> worker messages: small typed records; a running sequence sends only what changed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tengyun.lora.request import LoRARequest
from tengyun.prompt_embeds import PromptEmbeds
from tengyun.sampling_params import SamplingParams


@dataclass
class NewSeqData:
    """A sequence the worker has not seen, or one resumed after preemption (state restarts)."""

    seq_id: int
    token_ids: list[int]  # prompt + outputs generated so far
    num_prompt_tokens: int
    block_table: list[int]
    num_computed_tokens: int  # > 0 when the prefix cache served the first tokens
    sampling_params: SamplingParams
    state_slot: int = -1  # hybrid models: the StatePool slot of its recurrent state (-1: none)
    lora_request: LoRARequest | None = field(default=None, kw_only=True)  # its adapter; None: the base model
    pooling_params: Any = None  # a pooling request's PoolingParams (resolved); None: it samples
    # Its prompt as embeddings (rows for token_ids[:num_prompt_tokens], which are placeholders); None: ids.
    prompt_embeds: PromptEmbeds | None = field(default=None, kw_only=True)


@dataclass
class CachedSeqData:
    """A sequence the worker already holds; it appends its own sampled tokens."""

    seq_id: int
    new_block_ids: list[int]
    num_computed_tokens: int
    # Speculative decoding: drafts to verify after the last token (scheduled as 1 + len tokens).
    spec_token_ids: list[int] = field(default_factory=list)
    # Hybrid models with drafts: a free state slot for this step, where the worker copies the
    # sequence's state before the step and restores it from on a rejection.
    backup_state_slot: int = -1


@dataclass
class SchedulerOutput:
    new_seqs: list[NewSeqData] = field(default_factory=list)
    cached_seqs: list[CachedSeqData] = field(default_factory=list)
    num_scheduled_tokens: dict[int, int] = field(default_factory=dict)  # seq_id -> tokens this step
    freed_seq_ids: list[int] = field(default_factory=list)  # finished, aborted or preempted
    # Hybrid prefix caching (engine/state_snapshots.py): recurrent-state copies between slots and
    # snapshot rows, (snapshot row, slot) before the model runs and (slot, snapshot row) after.
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # Beam search: KV block copies (src, dst), made before the model runs (BlockManager copy on write).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # --data-parallel-size with --enable-expert-parallel: (unfinished requests, newest wave seen) for
    # the replicas' vote at the step's start (engine/data_parallel_wave.py); None otherwise
    dp_wave: tuple[int, int] | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class PromptLogprobsChunk:
    """Logprobs of prompt tokens [start, start + len(ranks)) from one prefill chunk.

    Row j scores prompt token start + j with the logits at position start + j - 1; lists are
    [actual token, top-1, ..., top-k]. Positions [0, 4) of a 10-token prompt -> start 1, rows for
    tokens 1..4; positions [4, 8) of a 6-token prompt (recomputed after preemption, 2 outputs)
    -> start 5, one row: positions 5.. predict output tokens.
    """

    start: int  # >= 1: the first prompt token has no logprob
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # of the actual token, 1 = most likely


@dataclass
class ModelRunnerOutput:
    """Per sequence that sampled this step, one entry per new token: one token, or with
    speculative decoding the accepted drafts and the token after them ([d1, d2, x] when 2 of
    3 drafts held). Logprob rows are [token, top-1, ..., top-k]."""

    sampled_token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprob_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    logprobs: dict[int, list[list[float]]] = field(default_factory=dict)
    sampled_ranks: dict[int, list[int]] = field(default_factory=dict)
    # Speculative decoding with a draft model (mtp): drafts to verify after each sequence's new tokens.
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Sequences with SamplingParams.prompt_logprobs whose prompt was (partly) computed this step.
    prompt_logprobs: dict[int, PromptLogprobsChunk] = field(default_factory=dict)
    # Pooling requests whose last prompt token was computed this step: the pooled output, plain
    # lists ([D], or [T, D] for ALL pooling); the sequence is done.
    pooled: dict[int, list] = field(default_factory=dict)
    # --enable-expert-load-metrics: (layer, expert, tokens routed to it this step), nonzero ones only.
    expert_load: list[tuple[int, int, int]] = field(default_factory=list)
    # --data-parallel-size with --enable-expert-parallel: the replicas' vote, whether they all step again
    dp_keep_stepping: bool = False
