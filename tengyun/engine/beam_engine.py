"""LLMEngine's beam search part: queueing a BeamSearchParams request and turning each round's
reports into forked beams (engine/beam_request.py says how a search runs)."""

from __future__ import annotations

import time

from tengyun.beam_search import BeamSearchParams, BeamSearchSequence, beam_width_problem
from tengyun.engine.beam_request import BeamRequest
from tengyun.engine.messages import ModelRunnerOutput
from tengyun.engine.sequence import Sequence
from tengyun.lora.request import LoRARequest
from tengyun.outputs import RequestMetrics
from tengyun.sampling_params import RequestOutputKind, SamplingParams


class BeamSearchEngineMixin:
    """Mixed into LLMEngine; uses its config, scheduler, tokenizer, requests, seqs and counters."""

    def _add_beam_request(self, request_id: str, prompt: str | list[int], params: BeamSearchParams,
                          arrival_time: float | None, first_turn: int, lora_request: LoRARequest | None) -> BeamRequest:
        self._check_beam_search(params, prompt)
        text, token_ids = self._tokenize(prompt)
        self._check_lora(lora_request)
        max_steps = min(params.max_tokens, self.config.max_model_len - len(token_ids))
        metrics = RequestMetrics(arrival_time or time.time(), max_tokens=max_steps)
        request = BeamRequest(request_id, text, token_ids, params, metrics, self.eos_token_ids, max_steps,
                              self.tokenizer)
        # Each beam computes one token a round and reports its 2 x beam_width best next tokens
        # (raw logprobs, as vLLM); the token it samples is not kept unless chosen.
        step = SamplingParams(temperature=params.temperature, max_tokens=1, logprobs=2 * params.beam_width,
                              ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
        seq = Sequence(next(self._seq_ids), request_id, 0, token_ids, step, arrival_order=0, turn=first_turn,
                       lora_request=lora_request)
        seq.arrival_order = seq.seq_id
        request.start(seq)
        self.seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        self.requests[request_id] = request
        self.prompt_tokens += len(token_ids)
        return request

    def _check_beam_search(self, params: BeamSearchParams, prompt: object) -> None:
        config, width = self.config, params.beam_width
        if self.config.pooling is not None:
            raise ValueError("This server runs a pooling model (--runner pooling): beam search needs a model "
                             "that generates text.")
        if self.scheduler.state_pool is not None:
            raise ValueError("Beam search is not supported on hybrid models (linear-attention layers, as "
                             "Qwen3.5's): their recurrent state cannot be forked between beams yet. Sample "
                             "several answers with n instead.")
        if config.speculative_config is not None:
            raise ValueError("Beam search does not run with speculative decoding: start the engine without "
                             "--speculative-config to use it.")
        problem = beam_width_problem(width, config.max_logprobs, config.max_num_seqs)
        if problem is not None:
            raise ValueError(problem)
        if not isinstance(prompt, (str, list)):
            raise ValueError(f"beam search takes a prompt as text or token ids, not {type(prompt).__name__} "
                             f"(as vLLM, prompt embeddings are not searched).")

    def _took_beam_report(self, seq: Sequence, request: object, result: ModelRunnerOutput, now: float,
                          changed: dict) -> bool:
        """A beam's step result, taken here (True) or left to sampling (False, not a beam): its
        candidates recorded and the beam parked (blocks kept); the last of its round's beams to
        report advances the search (the request then changed)."""
        if not isinstance(request, BeamRequest):
            return False
        ids, values = result.logprob_token_ids[seq.seq_id][0], result.logprobs[seq.seq_id][0]
        request.receive(seq, self._logprob_entry(ids, values, result.sampled_ranks[seq.seq_id][0]))
        self.scheduler.park(seq)
        self.generation_tokens += 1
        if request.round_complete:
            request.metrics.first_token_time = request.metrics.first_token_time or now
            request.metrics.last_token_time = now
            request.next_round(self._fork_beam, self._release_beam)
            changed[request.request_id] = request
        return True

    def _fork_beam(self, parent: Sequence, beam: BeamSearchSequence) -> Sequence:
        child = Sequence(next(self._seq_ids), parent.request_id, 0, parent.prompt_token_ids, parent.sampling_params,
                         arrival_order=parent.arrival_order, turn=parent.turn, token_ids=beam.tokens,
                         output_logprobs=beam.logprobs, cumulative_logprob=beam.cum_logprob,
                         lora_request=parent.lora_request)
        self.scheduler.fork(parent, child)
        self.seqs[child.seq_id] = child
        return child

    def _release_beam(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.seqs.pop(seq.seq_id, None)
