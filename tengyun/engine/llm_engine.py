"""LLMEngine: requests in, RequestOutputs out; one step = schedule, run the model, check stops.

Pure Python: the worker (torch) is passed in as an executor with ``execute_model``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from tengyun.config import EngineConfig
from tengyun.beam_search import BeamSearchParams
from tengyun.engine.beam_engine import BeamSearchEngineMixin
from tengyun.engine.data_parallel_wave import DataParallelWave
from tengyun.engine.detokenizer import IncrementalDetokenizer
from tengyun.engine.messages import ModelRunnerOutput, PromptLogprobsChunk, SchedulerOutput
from tengyun.engine.request import Request
from tengyun.engine.scheduler import Scheduler
from tengyun.engine.sequence import Sequence
from tengyun.lora.peft_adapter import read_peft_adapter
from tengyun.lora.request import LoRARequest
from tengyun.outputs import FinishReason, Logprob, RequestMetrics, RequestOutput, RequestProgress
from tengyun.pooling_params import PoolingParams
from tengyun.prompt_embeds import PromptEmbeds
from tengyun.sampling_params import RequestOutputKind, SamplingParams
from tengyun.spec_decode.drafter import Drafter
from tengyun.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger(__name__)


class Executor(Protocol):
    num_blocks: int  # KV blocks every rank holds

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    # Optional: check_health() raises if a worker died; shutdown() stops worker processes;
    # submit(sched) and next_result() run steps in a pipeline (results in submission order).


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks referenced by sequences
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_kv_blocks: int = 0  # blocks the KV cache holds (fixed once the engine is built)
    spec_decode: SpecDecodeStats | None = None  # totals so far; None without --speculative-config
    # LoRA adapters (names) of the running and the waiting sequences, for vllm:lora_requests_info
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    # --enable-expert-load-metrics: {(layer, expert): tokens routed to it so far}; None when off
    expert_load: dict[tuple[int, int], int] | None = None


class LLMEngine(BeamSearchEngineMixin):  # beam search: engine/beam_engine.py
    def __init__(self, config: EngineConfig, tokenizer: Any, executor: Executor, eos_token_ids: set[int],
                 check_structured_outputs: Callable[[Any], Any] | None = None):
        self.config = config
        # Compiles a request's grammar (raising ValueError) before it is queued; None: not checked here.
        self.check_structured_outputs = check_structured_outputs
        self.tokenizer = tokenizer
        self.executor = executor
        # Each local rank's memory once loaded (weights, measured step peak, KV, headroom), as JSON
        self.memory_reports: list[dict] = list(getattr(executor, "memory_reports", []))
        self.eos_token_ids = eos_token_ids
        self.vocab_size = config.model_spec.vocab_size
        self.batches_in_flight = _batches_in_flight(config, executor)
        # --data-parallel-size with --enable-expert-parallel: this replica steps with the others
        self.dp_wave = DataParallelWave() if config.enable_expert_parallel and config.data_parallel_size > 1 else None
        self.scheduler = Scheduler(config, executor.num_blocks, executor.num_state_slots,
                                   num_state_snapshots=executor.num_state_snapshots,
                                   drafter=Drafter.from_config(config), batches_in_flight=self.batches_in_flight)
        self._in_flight: deque[SchedulerOutput] = deque()  # submitted, oldest first
        self.requests: dict[str, Request] = {}
        self.seqs: dict[int, Sequence] = {}
        self._seq_ids = itertools.count()
        # Aborted requests, reported by the next step.
        self._pending_outputs: list[RequestOutput] = []
        self._pending_progress: list[RequestProgress] = []
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.expert_load: dict[tuple[int, int], int] | None = {} if config.enable_expert_load_metrics else None
        self._checked_loras: dict[int, LoRARequest] = {}  # lora_int_id -> the request whose folder was checked

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        config.finalize()
        from tengyun.executor import create_executor
        from tengyun.structured_output import grammar_compiler_for_config
        from tengyun.tokenizer import eos_token_ids, get_tokenizer

        tokenizer = get_tokenizer(config)
        executor = create_executor(config)  # this process, or one process per rank
        return cls(config, tokenizer, executor, eos_token_ids(config, tokenizer),
                   check_structured_outputs=lambda spec: grammar_compiler_for_config(config).compile(spec))

    # ----- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | PromptEmbeds,
                    params: SamplingParams | PoolingParams,
                    arrival_time: float | None = None, first_turn: int = 0,
                    lora_request: LoRARequest | None = None) -> Request:
        """Validate and queue a request. Raises ValueError naming the bad field; then nothing
        has been queued and other requests are untouched. `first_turn`: where this request's
        sequences start in the round-robin between API requests (prompt i of a request with n
        copies starts at i * n; see Scheduler.add). PoolingParams: a pooling request (prefill
        only; its one output is a PoolingRequestOutput)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        if isinstance(params, PoolingParams):
            return self._add_pooling_request(request_id, prompt, params, arrival_time, first_turn)
        if isinstance(params, BeamSearchParams):  # one RequestOutput at the end, beams best first
            return self._add_beam_request(request_id, prompt, params, arrival_time, first_turn, lora_request)
        if self.config.pooling is not None:
            raise ValueError("This server runs a pooling model (--runner pooling): it answers /v1/embeddings, "
                             "/pooling, /classify, /score and /rerank, not text generation.")
        text, token_ids = self._tokenize(prompt)
        embeds = prompt if isinstance(prompt, PromptEmbeds) else None
        if embeds is not None and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not compatible with prompt embeds.")  # vLLM's words
        params = self._resolve_params(params, len(token_ids))
        self._check_lora(lora_request)
        if params.structured_outputs is not None and self.check_structured_outputs is not None:
            self.check_structured_outputs(params.structured_outputs)
        metrics = RequestMetrics(arrival_time or time.time(), max_tokens=params.max_tokens)
        request = Request(request_id, text, token_ids, params, metrics)
        for index in range(params.n):
            child = (params if params.n == 1 or params.seed is None
                     else dataclasses.replace(params, seed=params.seed + index))
            seq = Sequence(next(self._seq_ids), request_id, index, token_ids, child, arrival_order=0,
                           turn=first_turn + index, lora_request=lora_request, prompt_embeds=embeds)
            seq.arrival_order = seq.seq_id
            request.seqs.append(seq)
            request.detokenizers.append(IncrementalDetokenizer(self.tokenizer, [] if embeds else token_ids, child))
            self.seqs[seq.seq_id] = seq
            self.scheduler.add(seq)
        self.requests[request_id] = request
        self.prompt_tokens += len(token_ids)
        return request

    def _add_pooling_request(self, request_id: str, prompt: str | list[int], params: PoolingParams,
                             arrival_time: float | None, first_turn: int) -> Request:
        """One prefill-only sequence; its pooled output finishes it (_finish_pooled)."""
        model = self.config.pooling
        if model is None:
            raise ValueError("This model generates text (--runner generate): embeddings, classification and scores "
                             "need a model served with --runner pooling.")
        params = params.resolved(model, self.config.served_model_name)
        hidden = self.config.model_spec.hidden_size
        if params.task in ("embed", "encode") and params.dimensions is not None and params.dimensions > hidden:
            raise ValueError(f"dimensions {params.dimensions} is more than the model's hidden size {hidden}.")
        text, token_ids = self._tokenize(prompt, pooling=params)
        placeholder = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)  # never sampled
        request = Request(request_id, text, token_ids, placeholder, RequestMetrics(arrival_time or time.time()),
                          pooling_params=params)
        seq = Sequence(next(self._seq_ids), request_id, 0, token_ids, placeholder, arrival_order=0, turn=first_turn,
                       pooling_params=params)
        seq.arrival_order = seq.seq_id
        request.seqs.append(seq)
        self.seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        self.requests[request_id] = request
        self.prompt_tokens += len(token_ids)
        return request

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.is_finished:
                    seq.finish_reason = FinishReason.ABORT
                    self.scheduler.finish(seq)
            self._report(request, self._pending_outputs, self._pending_progress)

    def has_unfinished_requests(self) -> bool:
        """Anything to step for: requests, reports, batches in flight, or a data-parallel wave."""
        return bool(self.requests) or bool(self._pending_progress) or bool(self._in_flight) or \
            (self.dp_wave is not None and self.dp_wave.active)

    def start_wave(self, wave: int) -> None:
        """StartWave(wave) from the API server: step with the other replicas (data_parallel_wave.py)."""
        self.dp_wave.start(wave)

    def _tokenize(self, prompt: str | list[int] | PromptEmbeds,
                  pooling: PoolingParams | None = None) -> tuple[str | None, list[int]]:
        """(text, token ids), checked against the vocabulary and --max-model-len; a pooling
        request's truncated to its truncate_prompt_tokens first (the last k tokens, as vLLM).
        Embeddings: checked against the model, one placeholder id per row."""
        if isinstance(prompt, PromptEmbeds):
            prompt.check_against_model(self.config.enable_prompt_embeds, self.config.model_spec.hidden_size)
            token_ids, text = prompt.placeholder_token_ids(), None
        elif isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError("You cannot pass text prompts when `skip_tokenizer_init` is True: send token ids, or "
                             "start without --skip-tokenizer-init.")
        elif isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, Mapping):  # LLM.generate's {"prompt_token_ids": [...]} form, one level up
            raise ValueError(f"prompt must be a string or a list of token ids, not a {type(prompt).__name__} "
                             f"(keys {sorted(prompt)[:3]}): pass prompt_token_ids' list itself.")
        else:
            token_ids, text = list(prompt), None
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids holds ids outside [0, {self.vocab_size}): {bad[:5]}.")
        if not token_ids:
            raise ValueError("prompt must not be empty.")
        max_len = self.config.max_model_len
        if pooling is not None:
            return text, self._pooling_prompt(token_ids, pooling)
        if len(token_ids) >= max_len:
            raise ValueError(
                f"The prompt has {len(token_ids)} tokens but --max-model-len is {max_len}, which "
                f"leaves no room to generate: shorten the prompt below {max_len} tokens or raise "
                f"--max-model-len to at least {len(token_ids) + 1}."
            )
        return text, token_ids

    def _pooling_prompt(self, token_ids: list[int], params: PoolingParams) -> list[int]:
        """truncate_prompt_tokens applied, then the prompt checked against --max-model-len (vLLM's wording)."""
        max_len, keep = self.config.max_model_len, params.truncate_prompt_tokens
        if keep is not None:
            if keep > max_len:
                raise ValueError(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_len}). "
                                 f"Please, select a smaller truncation size.")
            token_ids = token_ids[-(max_len if keep == -1 else keep):]
        if len(token_ids) > max_len:
            operation = {"classify": "classification", "score": "score"}.get(params.task, "embedding generation")
            raise ValueError(f"This model's maximum context length is {max_len} tokens. However, you requested "
                             f"{len(token_ids)} tokens in the input for {operation}. Please reduce the length of "
                             f"the input.")
        return token_ids

    def _check_lora(self, lora_request: LoRARequest | None) -> None:
        """An adapter this engine can serve: its folder read and checked against the model, once per
        lora_int_id (tengyun/lora/peft_adapter.py); raises ValueError naming the adapter if not."""
        if lora_request is None:
            return
        if not self.config.enable_lora:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} was requested but LoRA is not enabled: "
                             f"start the engine with --enable-lora (LLM(enable_lora=True)).")
        if self._checked_loras.get(lora_request.lora_int_id) != lora_request:
            read_peft_adapter(lora_request, self.config.model_spec, self.config.max_lora_rank)
            self._checked_loras[lora_request.lora_int_id] = lora_request

    def _resolve_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """Checked against --max-logprobs and the vocabulary; logprobs -1 becomes the vocabulary
        size, so the worker reads counts only; stream_interval at least --stream-interval."""
        params.check_against_model(self.config.max_logprobs, self.vocab_size)
        if self.tokenizer is None:
            params = _without_text(params)
        room = self.config.max_model_len - prompt_len
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        eos = set() if params.ignore_eos else set(self.eos_token_ids)
        whole = {name: self.vocab_size for name in ("logprobs", "prompt_logprobs") if getattr(params, name) == -1}
        stream_interval = max(params.stream_interval or 1, self.config.stream_interval)
        return dataclasses.replace(params, max_tokens=max_tokens, stream_interval=stream_interval,
                                   all_stop_token_ids=eos | set(params.stop_token_ids), **whole)

    # ----- the loop -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return the outputs of the requests that changed, each in its
        SamplingParams.output_kind (a running FINAL_ONLY request has none)."""
        return self.step_with_progress()[0]

    def step_with_progress(self) -> tuple[list[RequestOutput], list[RequestProgress]]:
        """step(), and the progress of every request that changed (aborted ones included),
        whatever its output kind: what metrics read.

        Pipeline parallel (batches_in_flight P > 1): submit scheduled batches until P are in
        flight (or nothing more can be scheduled), then take the oldest one's result. Stage 1
        runs batch k + 1 while stage 2 runs batch k; a sequence's tokens are appended when its
        batch comes back, and the scheduler leaves it out of batches until then."""
        outputs, self._pending_outputs = self._pending_outputs, []
        progress, self._pending_progress = self._pending_progress, []
        if self.batches_in_flight == 1:
            sched = self.scheduler.schedule()
            if sched.is_empty and not (self.dp_wave is not None and self.dp_wave.active):
                return outputs, progress
            self._note_scheduled(sched)
            if self.dp_wave is not None:  # an empty batch too: every replica votes and exchanges each step
                sched.dp_wave = self.dp_wave.vote(len(self.requests))
            result = self.executor.execute_model(sched)
            if self.dp_wave is not None:
                self.dp_wave.voted(result.dp_keep_stepping)
        else:
            while len(self._in_flight) < self.batches_in_flight:
                sched = self.scheduler.schedule()
                if sched.is_empty:
                    break
                self._note_scheduled(sched)
                self.executor.submit(sched)
                self._in_flight.append(sched)
            if not self._in_flight:
                return outputs, progress
            sched, result = self._in_flight.popleft(), self.executor.next_result()
        self._apply(sched, result, outputs, progress)
        return outputs, progress

    def _note_scheduled(self, sched: SchedulerOutput) -> None:
        now = time.time()
        for new in sched.new_seqs:
            metrics = self.requests[self.seqs[new.seq_id].request_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now

    def _apply(self, sched: SchedulerOutput, result: ModelRunnerOutput, outputs: list[RequestOutput],
               progress: list[RequestProgress]) -> None:
        """A batch's result: tokens appended, stops checked, changed requests reported. Sequences
        aborted while it ran are gone from self.seqs (or finished) and skipped."""
        self.scheduler.advance(sched, self.seqs, result.sampled_token_ids)
        for layer, expert, tokens in result.expert_load:
            self.expert_load[layer, expert] = self.expert_load.get((layer, expert), 0) + tokens
        for seq_id, chunk in result.prompt_logprobs.items():
            if seq_id in self.seqs:
                self._record_prompt_logprobs(self.requests[self.seqs[seq_id].request_id], chunk)
        now = time.time()
        changed: dict[str, Request] = {}
        self._finish_pooled(result, now, changed)
        for seq_id, token_ids in result.sampled_token_ids.items():
            seq = self.seqs.get(seq_id)
            if seq is None or seq.is_finished:
                continue
            request = self.requests[seq.request_id]
            if self._took_beam_report(seq, request, result, now, changed):
                continue
            for index, token_id in enumerate(token_ids):  # > 1 token: accepted speculative drafts
                if seq.is_finished:
                    break  # a stop among them drops the rest
                self._append_token(seq, request, token_id, result, now, index)
            seq.proposed_token_ids = result.draft_token_ids.get(seq_id, [])
            changed[request.request_id] = request
        for request in changed.values():
            self._report(request, outputs, progress)

    def _finish_pooled(self, result: ModelRunnerOutput, now: float, changed: dict[str, Request]) -> None:
        """Pooling requests whose prompt is computed: output kept, sequence finished (its blocks
        freed; with prefix caching its full blocks stay cached for later prompts)."""
        for seq_id, data in result.pooled.items():
            seq = self.seqs.get(seq_id)
            if seq is None or seq.is_finished:
                continue
            request = self.requests[seq.request_id]
            request.pooled = data
            request.metrics.first_token_time = request.metrics.last_token_time = now
            seq.finish_reason = FinishReason.STOP
            self.scheduler.finish(seq)
            changed[request.request_id] = request

    def _report(self, request: Request, outputs: list[RequestOutput], progress: list[RequestProgress]) -> None:
        """Add a changed request's output (if its kind has one now) and progress; retire it if finished."""
        if request.finished:
            self._retire(request)
        output = request.make_output()
        if output is not None:
            outputs.append(output)
        progress.append(request.progress())

    def _append_token(self, seq: Sequence, request: Request, token_id: int,
                      result: ModelRunnerOutput, now: float, index: int = 0) -> None:
        seq.append_token(token_id)
        self.generation_tokens += 1
        metrics = request.metrics
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        if seq.seq_id in result.logprobs:
            self._record_logprobs(seq, result, seq.seq_id, index)
        reason, stop = self._check_stop(seq, request, token_id)
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop
            self.scheduler.finish(seq)

    def _check_stop(self, seq: Sequence, request: Request, token_id: int):
        params = seq.sampling_params
        past_min = seq.num_output_tokens >= params.min_tokens
        if past_min and token_id in params.all_stop_token_ids:
            # stop_reason: the stop token id, or None for EOS (as vLLM reports it).
            return FinishReason.STOP, (token_id if token_id in params.stop_token_ids else None)
        stop_string = request.detokenizers[seq.index].update([token_id])
        if stop_string is not None and past_min:
            return FinishReason.STOP, stop_string
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _record_logprobs(self, seq: Sequence, result: ModelRunnerOutput, seq_id: int, index: int) -> None:
        """The logprobs of seq_id's index-th new token this step."""
        values = result.logprobs[seq_id][index]
        seq.output_logprobs.append(self._logprob_entry(result.logprob_token_ids[seq_id][index], values,
                                                       result.sampled_ranks[seq_id][index]))
        seq.cumulative_logprob += values[0]

    def _record_prompt_logprobs(self, request: Request, chunk: PromptLogprobsChunk) -> None:
        """Append the rows past what the request holds: a recompute after preemption, or a
        sibling sequence (n > 1), scores the same prompt tokens again; those rows are dropped."""
        have = len(request.prompt_logprobs)  # prompt tokens [0, have) are known
        if chunk.start > have:
            raise AssertionError(f"prompt logprobs of request {request.request_id} skip tokens "
                                 f"[{have}, {chunk.start}): a prefix-cache hit on a prompt_logprobs request?")
        for row in range(have - chunk.start, len(chunk.ranks)):
            request.prompt_logprobs.append(
                self._logprob_entry(chunk.token_ids[row], chunk.logprobs[row], chunk.ranks[row]))

    def _logprob_entry(self, ids: list[int], values: list[float], rank: int) -> dict[int, Logprob]:
        """[token, top-1, ..., top-k] -> {token: Logprob(rank), top-1: Logprob(1), ...}; the
        token keeps its own rank when it is also among the top-k."""
        entry = {ids[0]: Logprob(values[0], rank, self._piece(ids[0]))}
        for top_rank, (token, value) in enumerate(zip(ids[1:], values[1:]), start=1):
            entry.setdefault(token, Logprob(value, top_rank, self._piece(token)))
        return entry

    def _piece(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _retire(self, request: Request) -> None:
        request.metrics.finished_time = time.time()
        for seq in request.seqs:
            self.seqs.pop(seq.seq_id, None)
        self.requests.pop(request.request_id, None)

    def check_health(self) -> None:
        """Raise if the executor lost a worker (the error names the rank); cheap, call it while idle."""
        check = getattr(self.executor, "check_health", None)
        if check is not None:
            check()

    def shutdown(self) -> None:
        stop = getattr(self.executor, "shutdown", None)
        if stop is not None:
            stop()

    # ----- introspection ------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        bm = self.scheduler.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_kv_blocks=bm.num_blocks,
            spec_decode=self.scheduler.spec_stats.snapshot() if self.scheduler.spec_stats else None,
            expert_load=dict(self.expert_load) if self.expert_load is not None else None,
            running_loras=_lora_names(self.scheduler.running),
            waiting_loras=_lora_names(self.scheduler.waiting),
        )


def _without_text(params: SamplingParams) -> SamplingParams:
    """--skip-tokenizer-init: no detokenizing; what needs text is refused (as vLLM)."""
    if params.stop:
        raise ValueError("stop strings are only supported when detokenize is True: without a tokenizer "
                         "(--skip-tokenizer-init) use stop_token_ids.")
    if params.structured_outputs is not None:
        raise ValueError("Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'.")
    return dataclasses.replace(params, detokenize=False)


def _lora_names(seqs) -> tuple[str, ...]:
    """The adapters' names among ``seqs``, each once, sorted."""
    return tuple(sorted({seq.lora_request.lora_name for seq in seqs if seq.lora_request is not None}))


def _batches_in_flight(config: EngineConfig, executor: Executor) -> int:
    """How many batches the engine keeps in flight: --pipeline-parallel-size, or 1 where
    overlapping is off or not yet safe (logged with the reason)."""
    pp = config.pipeline_parallel_size
    if pp == 1:
        return 1
    reason = None
    if config.disable_pipeline_overlap:
        reason = "--disable-pipeline-overlap"
    elif not hasattr(executor, "submit"):
        reason = f"the {type(executor).__name__} executor runs one step at a time"
    elif config.speculative_config is not None:
        # The non-sampling ranks roll back rejected drafts by the previous step's drafts.
        reason = "speculative decoding (draft rollback assumes the previous step is the sequence's last)"
    elif executor.num_state_slots and config.enable_prefix_caching:
        # StateSnapshots commits a step's snapshot rows when the next step is scheduled.
        reason = "prefix caching on a hybrid model (state snapshots assume one step in flight)"
    if reason is not None:
        logger.info("Pipeline stages run one after another (one batch in flight): %s.", reason)
        return 1
    logger.info("Pipeline overlap: up to %d batches in flight.", pp)
    return pp
