"""Request: one add_request call; owns its n sequences and their detokenizers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tengyun.engine.detokenizer import IncrementalDetokenizer
from tengyun.engine.sequence import Sequence
from tengyun.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput
from tengyun.sampling_params import SamplingParams


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

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def make_output(self) -> RequestOutput:
        finished = self.finished
        outputs = []
        for seq, detok in zip(self.seqs, self.detokenizers):
            text = detok.get_next_output_text(finished=seq.is_finished, delta=False)
            outputs.append(CompletionOutput(
                index=seq.index,
                text=text,
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if self.params.logprobs is not None else None,
                logprobs=list(seq.output_logprobs) if self.params.logprobs is not None else None,
                finish_reason=str(seq.finish_reason) if seq.finish_reason else None,
                stop_reason=seq.stop_reason,
            ))
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=dataclasses.replace(self.metrics),  # a snapshot: the engine keeps updating its own
            num_cached_tokens=self.seqs[0].num_cached_tokens,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
        )
