"""ModelRunner: keeps per-sequence token state on the worker, builds each step's flat batch,
runs the model, and samples only at positions that end a sequence's known tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from tengyun.distributed.pipeline_stage import PipelineStage
from tengyun.engine.messages import ModelRunnerOutput, PromptLogprobsChunk, SchedulerOutput
from tengyun.layers.attention.metadata import AttentionMetadata, PrefillChunk, attention_metadata
from tengyun.layers.sampler import Sampler, SamplerOutput, SamplingMetadata, gather_logprobs
from tengyun.sampling_params import SamplingParams
from tengyun.worker.decode_graphs import DecodeGraphs
from tengyun.worker.grammar_state import GrammarState
from tengyun.worker.state_cache import StateSnapshotRows


@dataclass
class SeqState:
    token_ids: list[int]  # prompt + outputs; the runner appends what it samples
    num_prompt_tokens: int
    block_table: list[int]
    num_computed_tokens: int
    params: SamplingParams
    state_slot: int = -1  # hybrid models: row of the recurrent-state pool


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_seq_ids: list[int]  # sequences that sample, in logits row order
    logits_indices: torch.Tensor  # [len(sample_seq_ids)]: last token of each in the flat batch
    # Prompt logprobs: the R rows whose next token is a prompt token, of sequences that asked.
    prompt_rows: list[tuple[int, int, int]]  # (seq_id, first prompt token scored, rows), in row order
    prompt_indices: torch.Tensor | None = None  # [R] rows of the flat batch
    prompt_targets: torch.Tensor | None = None  # [R] the prompt token each row predicts


class ModelRunner:
    def __init__(self, model: nn.Module, block_size: int, vocab_size: int, device: torch.device,
                 grammar_compiler_factory: Callable[[], Any] | None = None,
                 stage: PipelineStage | None = None):
        self.model = model
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        # Pipeline parallel: activations in from the previous stage, out to the next.
        self.stage = stage or PipelineStage(0, torch.float32, device)
        self.sampler = Sampler()
        self.states: dict[int, SeqState] = {}
        # Structured output: per-sequence grammar matchers; the compiler is built on first use.
        self.grammar = GrammarState(grammar_compiler_factory or _no_grammar_compiler, vocab_size)
        # Decode-only steps replayed from captured graphs (worker/decode_graphs.py); None: eager.
        self.decode_graphs: DecodeGraphs | None = None
        # Hybrid models with prefix caching: recurrent-state snapshot copies; None: none kept.
        self.snapshot_rows: StateSnapshotRows | None = None

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput,
                sampled_elsewhere: dict[int, int] | None = None) -> ModelRunnerOutput | None:
        """Run one step. Returns None on ranks that do not sample (an earlier pipeline stage,
        a TP rank other than 0); ``sampled_elsewhere``: the tokens the sampling rank drew last
        step, which such ranks append before this step's inputs are built."""
        for seq_id, token in (sampled_elsewhere or {}).items():
            if seq_id in self.states:
                self.states[seq_id].token_ids.append(token)
        self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput()
        batch = self._prepare(sched)
        if sched.state_restores:
            self.snapshot_rows.restore(sched.state_restores)
        if self.decode_graphs is not None and self.decode_graphs.fits(batch.meta):
            hidden = self.decode_graphs.run(batch.input_ids, batch.positions, batch.meta)
        else:
            with attention_metadata(batch.meta):
                hidden = self.model(batch.input_ids, batch.positions, self.stage.receive(len(batch.input_ids)))
        if sched.state_saves:
            self.snapshot_rows.save(sched.state_saves)
        if not self.stage.is_last:
            self.stage.send(hidden)  # [hidden, residual]
            return None
        if not batch.sample_seq_ids and not batch.prompt_rows:
            return ModelRunnerOutput()
        rows = batch.logits_indices
        if batch.prompt_rows:
            rows = torch.cat([rows, batch.prompt_indices])
        logits = self.model.compute_logits(hidden[rows])  # [B + R, V] float32; None off TP rank 0
        if logits is None:
            return None
        num_sampled = len(batch.sample_seq_ids)
        result = ModelRunnerOutput()
        if num_sampled:
            states = [self.states[i] for i in batch.sample_seq_ids]
            metadata = SamplingMetadata.build(
                [s.params for s in states],
                [s.token_ids[: s.num_prompt_tokens] for s in states],
                [s.token_ids[s.num_prompt_tokens:] for s in states],
                self.vocab_size,
                self.device,
                token_bitmask=self.grammar.bitmask(batch.sample_seq_ids),
            )
            result = self._collect(batch.sample_seq_ids, states, self.sampler(logits[:num_sampled], metadata))
        if batch.prompt_rows:
            self._collect_prompt_logprobs(batch, logits[num_sampled:], result)
        return result

    def _update_states(self, sched: SchedulerOutput) -> None:
        for seq_id in sched.freed_seq_ids:
            self.states.pop(seq_id, None)
            self.grammar.discard(seq_id)
        for new in sched.new_seqs:
            self.states[new.seq_id] = SeqState(
                list(new.token_ids), new.num_prompt_tokens, list(new.block_table),
                new.num_computed_tokens, new.sampling_params, new.state_slot,
            )
            self.grammar.add(new.seq_id, new.sampling_params, new.token_ids[new.num_prompt_tokens:])
        for cached in sched.cached_seqs:
            state = self.states[cached.seq_id]
            state.block_table.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare(self, sched: SchedulerOutput) -> BatchInputs:
        """Flat batch: single-token sequences first (batched decode attention), then chunks."""
        counts = sched.num_scheduled_tokens
        order = sorted(counts, key=lambda seq_id: counts[seq_id] != 1)
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        decode_tables, decode_lens, decode_slots, prefills = [], [], [], []
        sample_seq_ids, logits_indices = [], []
        prompt_rows, prompt_indices, prompt_targets = [], [], []
        offset = 0
        for seq_id in order:
            state, n = self.states[seq_id], counts[seq_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            pos = np.arange(start, end)
            table = np.asarray(state.block_table, dtype=np.int64)
            input_ids.append(state.token_ids[start:end])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            if n == 1:
                decode_tables.append(table)
                decode_lens.append(end)
                decode_slots.append(state.state_slot)
            else:
                num_blocks = -(-end // bs)
                prefills.append(PrefillChunk(offset, n, start, torch.from_numpy(table[:num_blocks]).to(self.device),
                                             state.state_slot))
            if end == len(state.token_ids):
                sample_seq_ids.append(seq_id)
                logits_indices.append(offset + n - 1)
            if state.params.prompt_logprobs is not None:
                # Positions [start, last) predict prompt tokens start + 1 .. last.
                last = min(end, state.num_prompt_tokens - 1)
                if last > start:
                    prompt_rows.append((seq_id, start + 1, last - start))
                    prompt_indices.extend(range(offset, offset + last - start))
                    prompt_targets.extend(state.token_ids[start + 1:last + 1])
            offset += n
        meta = AttentionMetadata(
            slot_mapping=self._tensor(np.concatenate(slots)),
            num_decode_tokens=len(decode_lens),
            prefills=prefills,
        )
        if decode_lens:
            meta.decode_block_tables = self._tensor(_pad_rows(decode_tables))
            meta.decode_seq_lens = self._tensor(np.asarray(decode_lens, dtype=np.int64))
            meta.decode_state_slots = self._tensor(np.asarray(decode_slots, dtype=np.int64))
        return BatchInputs(
            input_ids=self._tensor(np.fromiter((t for ids in input_ids for t in ids), dtype=np.int64)),
            positions=self._tensor(np.concatenate(positions)),
            meta=meta,
            sample_seq_ids=sample_seq_ids,
            logits_indices=self._tensor(np.asarray(logits_indices, dtype=np.int64)),
            prompt_rows=prompt_rows,
            prompt_indices=self._tensor(np.asarray(prompt_indices, dtype=np.int64)) if prompt_rows else None,
            prompt_targets=self._tensor(np.asarray(prompt_targets, dtype=np.int64)) if prompt_rows else None,
        )

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _collect(self, seq_ids: list[int], states: list[SeqState], out: SamplerOutput) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        sampled = out.sampled_token_ids.tolist()
        for seq_id, state, token in zip(seq_ids, states, sampled):
            state.token_ids.append(token)
            self.grammar.accept(seq_id, token)
            result.sampled_token_ids[seq_id] = token
        if out.logprobs is not None:
            ids, logprobs, ranks = out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.sampled_ranks.tolist()
            for row, (seq_id, state) in enumerate(zip(seq_ids, states)):
                if state.params.logprobs is not None:
                    k = 1 + state.params.logprobs
                    result.logprob_token_ids[seq_id] = ids[row][:k]
                    result.logprobs[seq_id] = logprobs[row][:k]
                    result.sampled_ranks[seq_id] = ranks[row]
        return result

    def _collect_prompt_logprobs(self, batch: BatchInputs, logits: torch.Tensor, result: ModelRunnerOutput) -> None:
        """logits [R, V] (raw, as vLLM) of batch.prompt_rows -> one PromptLogprobsChunk per sequence.
        R <= the step's tokens, so memory stays within --max-num-batched-tokens x vocab floats."""
        wanted = {seq_id: self.states[seq_id].params.prompt_logprobs for seq_id, _, _ in batch.prompt_rows}
        max_k = min(max(wanted.values()), self.vocab_size)
        ids, logprobs, ranks = gather_logprobs(logits.log_softmax(dim=-1), batch.prompt_targets, max_k)
        ids, logprobs, ranks = ids.tolist(), logprobs.tolist(), ranks.tolist()
        row = 0
        for seq_id, start, count in batch.prompt_rows:
            k, rows = 1 + wanted[seq_id], slice(row, row + count)
            result.prompt_logprobs[seq_id] = PromptLogprobsChunk(
                start, [r[:k] for r in ids[rows]], [r[:k] for r in logprobs[rows]], ranks[rows])
            row += count


def _no_grammar_compiler() -> Any:
    raise ValueError("This model runner was built without a grammar compiler: structured output is unavailable.")


def _pad_rows(rows: list[np.ndarray]) -> np.ndarray:
    """[[3, 7], [5]] -> [[3, 7], [5, 0]]"""
    out = np.zeros((len(rows), max(len(r) for r in rows)), dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out
