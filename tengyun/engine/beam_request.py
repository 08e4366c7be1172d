"""BeamRequest: one beam search in the engine, its beams as Sequences that share KV blocks.

A search runs in rounds. In round r every live beam (prompt + r tokens) computes its last
token's logits, one token of work, and reports its 2 x beam_width most likely next tokens
(plus the sampled one when temperature > 0, as vLLM). When all live beams of the round have
reported, every candidate (parent, token) is scored (tengyun/beam_search.py); EOS candidates
finish, and the beam_width best others continue as new Sequences forked from their parents
(Scheduler.fork: the parent's blocks shared, the partly filled last one copied on write), so
no beam ever recomputes a token another beam computed. The parents are then released.

Invariants: ``seqs`` are this round's beams, each RUNNING, WAITING (preempted) or PARKED
(reported, blocks kept for its children); ``completed`` holds at most beam_width finished
beams, best first, earlier finishers ahead on ties (vLLM's stable sort over all of them picks
the same ones). A beam keeps its cumulative logprob and per-step candidates on its Sequence
(cumulative_logprob, output_logprobs).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from tengyun.beam_search import BeamSearchParams, BeamSearchSequence, create_sort_beams_key_function
from tengyun.engine.sequence import Sequence
from tengyun.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, RequestProgress

Candidates = dict[int, Logprob]  # one beam's next-token candidates: token -> logprob


class BeamRequest:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: BeamSearchParams,
                 metrics: RequestMetrics, eos_token_ids: set[int], max_steps: int, tokenizer: Any):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.metrics = metrics
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.max_steps = max_steps  # rounds: max_tokens capped at --max-model-len - prompt length
        self.tokenizer = tokenizer
        self.sort_key = create_sort_beams_key_function(self.eos_token_ids, params.length_penalty)
        self.seqs: list[Sequence] = []  # this round's beams
        self.first_seq: Sequence | None = None  # the prompt's: its prefix-cache hit is the request's
        self.reported: dict[int, Candidates] = {}  # seq_id -> its candidates, this round
        self.completed: list[BeamSearchSequence] = []
        self.final: list[BeamSearchSequence] | None = None  # set when the search ends
        self.num_steps = 0

    # ----- rounds ---------------------------------------------------------------------------
    def start(self, seq: Sequence) -> None:
        self.seqs = [seq]
        self.first_seq = seq

    def receive(self, seq: Sequence, candidates: Candidates) -> None:
        self.reported[seq.seq_id] = candidates

    @property
    def round_complete(self) -> bool:
        return bool(self.seqs) and all(seq.seq_id in self.reported for seq in self.seqs)

    def next_round(self, fork: Callable[[Sequence, BeamSearchSequence], Sequence],
                   release: Callable[[Sequence], None]) -> None:
        """Rank this round's candidates; the best continue as ``fork(parent, beam)`` (unless the
        search ends now), then every parent is ``release``d."""
        self.num_steps += 1
        survivors = self._rank_candidates()
        self.reported.clear()
        ended_early = self._cannot_improve(survivors)
        if self.num_steps >= self.max_steps or not survivors or ended_early:
            # early_stopping True answers with the finished beams; otherwise live ones compete too
            live = [] if ended_early and self.params.early_stopping is True else [beam for _, beam in survivors]
            for beam in live:
                beam.finish_reason = "length"
            self.final = sorted(self.completed + live, key=self.sort_key, reverse=True)[:self.params.beam_width]
            children = []
        else:
            children = [fork(parent, beam) for parent, beam in survivors]
        for parent in self.seqs:
            release(parent)
        self.seqs = children

    def _rank_candidates(self) -> list[tuple[Sequence, BeamSearchSequence]]:
        """The beam_width best non-EOS candidates as (parent, beam), best first; EOS candidates
        join ``completed``. Candidates are visited beam by beam in each beam's candidate order
        (sampled token, then by rank), as vLLM does, so ties break alike."""
        width, lp = self.params.beam_width, self.params.length_penalty
        scored: list[tuple[float, Sequence, int, Logprob]] = []
        for parent in self.seqs:
            candidates = self.reported[parent.seq_id]
            length = parent.num_tokens + 1
            for token, logprob in candidates.items():
                if token in self.eos_token_ids:
                    self.completed.append(self._beam(parent, token, logprob, candidates, "stop"))
                else:
                    scored.append(((parent.cumulative_logprob + logprob.logprob) / length ** lp,
                                   parent, token, logprob))
        self.completed = sorted(self.completed, key=self.sort_key, reverse=True)[:width]
        scored.sort(key=lambda entry: entry[0], reverse=True)
        return [(parent, self._beam(parent, token, logprob, self.reported[parent.seq_id], None))
                for _, parent, token, logprob in scored[:width]]

    def _beam(self, parent: Sequence, token: int, logprob: Logprob, candidates: Candidates,
              finish_reason: str | None) -> BeamSearchSequence:
        return BeamSearchSequence(
            tokens=parent.token_ids + [token], logprobs=parent.output_logprobs + [candidates],
            lora_request=parent.lora_request, cum_logprob=parent.cumulative_logprob + logprob.logprob,
            finish_reason=finish_reason, stop_reason=token if finish_reason == "stop" else None)

    def _cannot_improve(self, survivors: list[tuple[Sequence, BeamSearchSequence]]) -> bool:
        """Whether searching on can change the answer: early_stopping True ends the search once
        beam_width beams finished; otherwise it ends when no live beam, at its best possible
        score, beats the beam_width-th finished one. A beam's cumulative logprob only falls, so
        its best possible score is at the longest length when length_penalty > 0 and at its
        current length otherwise: the answer is the one searching all max_tokens steps gives."""
        width, lp = self.params.beam_width, self.params.length_penalty
        if len(self.completed) < width:
            return False
        if self.params.early_stopping is True:
            return True
        worst_kept = self.sort_key(self.completed[width - 1])
        longest = len(self.prompt_token_ids) + self.max_steps
        return all(beam.cum_logprob / (longest if lp > 0 else len(beam.tokens)) ** lp <= worst_kept
                   for _, beam in survivors)

    # ----- the Request interface LLMEngine reports through ----------------------------------
    @property
    def finished(self) -> bool:
        return self.final is not None or all(seq.is_finished for seq in self.seqs)

    def make_output(self) -> RequestOutput | None:
        """One output, when the search ends (vLLM answers beam search in one piece): the
        beam_width best beams, best first; empty when aborted."""
        if not self.finished:
            return None
        outputs = [self._completion(i, beam) for i, beam in enumerate(self.final or [])]
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=outputs, finished=True, metrics=dataclasses.replace(self.metrics),
                             num_cached_tokens=self.first_seq.num_cached_tokens if self.first_seq else 0)

    def _completion(self, index: int, beam: BeamSearchSequence) -> CompletionOutput:
        """vLLM's shape: token ids and text after the prompt, a final EOS left out unless
        include_stop_str_in_output; cumulative logprob and per-step candidates always."""
        token_ids = beam.tokens[len(self.prompt_token_ids):]
        if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            token_ids = token_ids[:-1]
        text = self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""  # --skip-tokenizer-init
        return CompletionOutput(index=index, text=text, token_ids=token_ids,
                                cumulative_logprob=beam.cum_logprob, logprobs=beam.logprobs,
                                finish_reason=beam.finish_reason or "abort", stop_reason=beam.stop_reason)

    def progress(self) -> RequestProgress:
        beams = self.final if self.final is not None else []
        num_output = ([len(b.tokens) - len(self.prompt_token_ids) for b in beams] if beams
                      else [self.num_steps] * len(self.seqs))
        reasons = [b.finish_reason for b in beams] if beams else [
            "abort" if self.finished else None for _ in self.seqs]
        return RequestProgress(request_id=self.request_id, num_prompt_tokens=len(self.prompt_token_ids),
                               num_output_tokens=num_output, finish_reasons=reasons, finished=self.finished,
                               metrics=dataclasses.replace(self.metrics))
