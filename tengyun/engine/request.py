"""Request: one add_request call; owns its n sequences and their detokenizers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tengyun.engine.detokenizer import IncrementalDetokenizer
from tengyun.engine.sequence import Sequence
from tengyun.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput, RequestProgress
from tengyun.pooling_outputs import PoolingOutput, PoolingRequestOutput
from tengyun.pooling_params import PoolingParams
from tengyun.sampling_params import RequestOutputKind, SamplingParams


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    detokenizers: list[IncrementalDetokenizer] = field(default_factory=list)
    # [None, then one entry per prompt token received so far]; None when not asked for. Shared by
    # the n sequences: whichever computes a position first fills it, recomputes are dropped.
    prompt_logprobs: PromptLogprobs | None = None
    # Per sequence (by index), its output tokens when the last output was made (DELTA: the tokens
    # earlier outputs carried; every kind: what params.stream_interval counts from).
    num_returned_tokens: list[int] = field(default_factory=list)
    output_made: bool = False  # DELTA: the first output carried the prompt logprobs
    pooling_params: PoolingParams | None = None  # a pooling request (one sequence, prefill only)
    pooled: list | None = None  # its output once computed; None while it runs, or when aborted

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        self.num_returned_tokens = [0] * self.params.n

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def make_output(self) -> RequestOutput | None:
        """This step's output in the request's output kind (see RequestOutputKind); None while a
        FINAL_ONLY request runs. Every sequence appears, in index order, in every output: under
        DELTA one with nothing new since the last output has empty token_ids and text."""
        finished = self.finished
        if self.pooling_params is not None:
            return self._pooling_output() if finished else None
        kind = self.params.output_kind
        if not finished and (kind is RequestOutputKind.FINAL_ONLY or not self._output_due()):
            return None
        delta = kind is RequestOutputKind.DELTA
        prompt_logprobs = self.prompt_logprobs
        if delta and self.output_made:
            prompt_logprobs = None
        self.output_made = True
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[self._completion(seq, detok, delta) for seq, detok in zip(self.seqs, self.detokenizers)],
            finished=finished,
            metrics=dataclasses.replace(self.metrics),  # a snapshot: the engine keeps updating its own
            num_cached_tokens=self.seqs[0].num_cached_tokens,
            prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None,
        )

    def _output_due(self) -> bool:
        """Whether a running request's output goes out this step: its first, then (stream_interval
        N > 1) once some sequence has N tokens the last output did not count, or finished since."""
        interval = self.params.stream_interval or 1
        if interval == 1 or not self.output_made:
            return True
        for seq in self.seqs:
            new = seq.num_output_tokens - self.num_returned_tokens[seq.index]
            if new >= interval or (new and seq.is_finished):
                return True
        return False

    def _pooling_output(self) -> PoolingRequestOutput:
        return PoolingRequestOutput(self.request_id, PoolingOutput(self.pooled), self.prompt_token_ids, True,
                                    self.seqs[0].num_cached_tokens)

    def _completion(self, seq: Sequence, detok: IncrementalDetokenizer, delta: bool) -> CompletionOutput:
        """Sequence seq's output tokens [start, now): all of them, or (delta) those not yet returned."""
        start = self.num_returned_tokens[seq.index] if delta else 0
        self.num_returned_tokens[seq.index] = seq.num_output_tokens
        with_logprobs = self.params.logprobs is not None
        return CompletionOutput(
            index=seq.index,
            text=detok.get_next_output_text(finished=seq.is_finished, delta=delta),
            token_ids=seq.token_ids[seq.num_prompt_tokens + start:],
            cumulative_logprob=seq.cumulative_logprob if with_logprobs else None,
            logprobs=seq.output_logprobs[start:] if with_logprobs else None,
            finish_reason=str(seq.finish_reason) if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
        )

    def progress(self) -> RequestProgress:
        return RequestProgress(
            request_id=self.request_id,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_output_tokens=[seq.num_output_tokens for seq in self.seqs],
            finish_reasons=[str(seq.finish_reason) if seq.finish_reason else None for seq in self.seqs],
            finished=self.finished,
            metrics=dataclasses.replace(self.metrics),
        )
