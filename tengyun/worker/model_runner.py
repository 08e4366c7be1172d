"""ModelRunner: keeps per-sequence token state on the worker, builds each step's flat batch,
runs the model, and samples only at positions that end a sequence's known tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from tengyun.distributed.parallel_state import get_tp_rank
from tengyun.distributed.pipeline_stage import PipelineStage
from tengyun.engine.block_manager import blocks_to_keep
from tengyun.engine.messages import ModelRunnerOutput, PromptLogprobsChunk, SchedulerOutput
from tengyun.layers.attention.metadata import AttentionMetadata, PrefillChunk, attention_metadata
from tengyun.layers.kernels import KernelBundle, bind_kernels
from tengyun.layers.lora.batch import LoRABatch, lora_batch
from tengyun.layers.lora.manager import LoRAManager
from tengyun.layers.pooler import PooledRows
from tengyun.layers.sampler import Sampler, SamplerOutput
from tengyun.layers.sampling.logprobs import gather_logprobs
from tengyun.layers.sampling.metadata import SamplingMetadata
from tengyun.lora.request import LoRARequest
from tengyun.sampling_params import SamplingParams
from tengyun.spec_decode.verify import accepted_tokens
from tengyun.worker.decode_graphs import DecodeGraphs
from tengyun.worker.grammar_state import GrammarState
from tengyun.worker.kv_cache import copy_kv_blocks
from tengyun.worker.prompt_embeds_rows import PromptEmbedsRows
from tengyun.worker.sampling_inputs import SamplingInputs
from tengyun.worker.spec_state import RecurrentStateSnapshots
from tengyun.worker.state_cache import StateSnapshotRows


@dataclass
class SeqState:
    token_ids: list[int]  # prompt + outputs; the runner appends what it samples
    num_prompt_tokens: int
    block_table: list[int]
    num_computed_tokens: int
    params: SamplingParams
    state_slot: int = -1  # hybrid models: row of the recurrent-state pool
    lora: LoRARequest | None = field(default=None, kw_only=True)  # its adapter; None: the base model
    pooling: Any = None  # a pooling request's PoolingParams: pooled at its last prompt token, never sampled


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_seq_ids: list[int]  # sequences that sample, in logits row order
    # [S] rows: the last token of each sequence in the flat batch, then (speculative decoding)
    # one row per draft: a sequence verifying drafts [d1, d2] owns 3 consecutive rows.
    logits_indices: torch.Tensor
    # Prompt logprobs: the R rows whose next token is a prompt token, of sequences that asked.
    prompt_rows: list[tuple[int, int, int]]  # (seq_id, first prompt token scored, rows), in row order
    # (seq_id, first row, rows, first position) of each sequence in the flat batch, in row order
    chunks: list[tuple[int, int, int, int]] = field(default_factory=list)
    prompt_indices: torch.Tensor | None = None  # [R] rows of the flat batch
    prompt_targets: torch.Tensor | None = None  # [R] the prompt token each row predicts


class ModelRunner:
    def __init__(self, model: nn.Module, block_size: int, vocab_size: int, device: torch.device,
                 kernels: KernelBundle | None = None, grammar_compiler_factory: Callable[[], Any] | None = None,
                 stage: PipelineStage | None = None, decode_graphs: DecodeGraphs | None = None,
                 snapshot_rows: StateSnapshotRows | None = None, mtp: Any = None, lora: LoRAManager | None = None,
                 expert_load: Any = None):
        """Complete once constructed: ``kernels`` (the worker's bundle, bound to the sampler as to
        every layer; None: PyTorch's ops), ``decode_graphs`` (None: eager), ``snapshot_rows``
        (hybrid prefix caching; None: none kept), ``mtp`` (MtpProposer with --speculative-config
        method mtp; None: none), ``expert_load`` (ExpertLoadCounter with --enable-expert-load-metrics)."""
        self.model = model
        self.expert_load = expert_load
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        # Pipeline parallel: activations in from the previous stage, out to the next.
        self.stage = stage or PipelineStage(0, torch.float32, device)
        self.prompt_embeds = PromptEmbedsRows(model, device, self.stage.is_first)  # --enable-prompt-embeds
        self.sampler = Sampler()
        if kernels is not None:
            bind_kernels(self.sampler, kernels)
        self.sampling_inputs = SamplingInputs(vocab_size, device)  # kept across steps
        self.states: dict[int, SeqState] = {}
        # Structured output: per-sequence grammar matchers; the compiler is built on first use.
        self.grammar = GrammarState(grammar_compiler_factory or _no_grammar_compiler, vocab_size)
        # Decode-only steps replayed from captured graphs (worker/decode_graphs.py); None: eager.
        self.decode_graphs = decode_graphs
        self.spec_drafts: dict[int, list[int]] = {}  # this step's drafts per sequence (speculative decoding)
        self.spec_backups: dict[int, int] = {}  # hybrid models: the spare state slot of each (spec_state.py)
        self.state_snapshots = RecurrentStateSnapshots(model)  # hybrid models: undo rejected drafts
        self.mtp = mtp  # worker/mtp_proposer.py
        self.step_tables: dict[int, list[int]] = {}  # block tables held this step, before rollbacks
        # Hybrid models with prefix caching: recurrent-state snapshot copies; None: none kept.
        self.snapshot_rows = snapshot_rows
        self.lora = lora  # --enable-lora: the adapters' slots and each step's token -> slot map
        # --runner pooling: the model's pooler (layers/pooler.py) and the pooled rows of prompts in progress.
        # A pooling model samples nothing (a sequence without PoolingParams, as the memory profile's, only runs).
        self.samples = not hasattr(model, "pooler")
        self.pooler = getattr(model, "pooler", None)  # None on an earlier pipeline stage
        self.pooled_rows = PooledRows()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput,
                sampled_elsewhere: dict[int, list[int]] | None = None) -> ModelRunnerOutput | None:
        """Run one step. Returns None on ranks that do not sample (an earlier pipeline stage,
        a TP rank other than 0); ``sampled_elsewhere``: the tokens the sampling rank drew last
        step, which such ranks append (rolling back rejected drafts as it did) before this
        step's inputs are built."""
        for seq_id, tokens in (sampled_elsewhere or {}).items():
            state = self.states.get(seq_id)
            if state is None:
                continue
            drafts = self.spec_drafts.get(seq_id)  # last step's, until _update_states
            if drafts:
                self._roll_back(state, num_rejected=len(drafts) + 1 - len(tokens), num_new=len(tokens))
            state.token_ids.extend(tokens)
        self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput()
        batch = self._prepare(sched)
        if sched.block_copies:  # beam search's copy on write, before any KV is written
            copy_kv_blocks(self.model, sched.block_copies)
        if sched.state_restores:
            self.snapshot_rows.restore(sched.state_restores)
        if self.spec_drafts and self.state_snapshots.layers:
            self.state_snapshots.save([self.states[i].state_slot for i in self.spec_drafts],
                                      [self.spec_backups[i] for i in self.spec_drafts])
        inputs_embeds = self.prompt_embeds.inputs_embeds(batch.input_ids, batch.chunks)
        if inputs_embeds is None and self.decode_graphs is not None and self.decode_graphs.fits(batch.meta):
            hidden = self.decode_graphs.run(batch.input_ids, batch.positions, batch.meta)
        else:
            with attention_metadata(batch.meta), lora_batch(self._lora_batch(batch)):
                hidden = self.model(batch.input_ids, batch.positions, self.stage.receive(len(batch.input_ids)),
                                    inputs_embeds=inputs_embeds)
        if sched.state_saves:
            self.snapshot_rows.save(sched.state_saves)
        if not self.stage.is_last:
            self.stage.send(hidden)  # [hidden, residual]
            return None
        result = self._outputs(batch, hidden)  # None off TP rank 0
        if self.pooler is not None and get_tp_rank() == 0:
            self._pool(batch, hidden, result)
        if self.mtp is not None:
            self._propose_drafts(batch, hidden, result)
        if self.expert_load is not None and result is not None:
            result.expert_load = self.expert_load.take()  # one host read per step, all layers
        return result

    def _lora_batch(self, batch: BatchInputs) -> LoRABatch | None:
        """Which adapter slot each token runs with (adapters not in a slot are loaded now); None
        without --enable-lora or when every token runs the base model."""
        if self.lora is None:
            return None
        return self.lora.step_batch([(self.states[seq_id].lora, n) for seq_id, _, n, _ in batch.chunks])

    def _outputs(self, batch: BatchInputs, hidden: torch.Tensor) -> ModelRunnerOutput | None:
        """The last stage's tokens and prompt logprobs from hidden [T, H]; None off TP rank 0."""
        if not batch.sample_seq_ids and not batch.prompt_rows:
            return ModelRunnerOutput()
        rows = batch.logits_indices
        if batch.prompt_rows:
            rows = torch.cat([rows, batch.prompt_indices])
        logits = self.model.compute_logits(hidden[rows])  # [B + R, V] the model's dtype; None off TP rank 0
        if logits is None:
            return None
        num_sampled = len(batch.logits_indices)
        result = ModelRunnerOutput()
        if num_sampled:
            result = self._sample(batch.sample_seq_ids, logits[:num_sampled])
        if batch.prompt_rows:
            self._collect_prompt_logprobs(batch, logits[num_sampled:], result)
        return result

    def _pool(self, batch: BatchInputs, hidden: torch.Tensor, result: ModelRunnerOutput) -> None:
        """Pooling sequences' rows of hidden [T, H] into their pooled state; those whose prompt
        ends in this step get their output (the whole hidden state is on every TP rank: rank 0 pools)."""
        for seq_id, offset, n, start in batch.chunks:
            state = self.states[seq_id]
            if state.pooling is None:
                continue
            pooled = self.pooled_rows.add(seq_id, state.pooling, hidden[offset:offset + n], start,
                                          state.num_prompt_tokens)
            if pooled is not None:
                result.pooled[seq_id] = self.pooler(pooled, state.pooling).tolist()

    def _propose_drafts(self, batch: BatchInputs, hidden: torch.Tensor, result: ModelRunnerOutput | None) -> None:
        """The MTP head over this step's hidden [T, H] (every step: its KV follows the target's);
        the drafts of the sequences that got tokens go into ``result`` on TP rank 0. The other TP
        ranks run the head on their shards, with the new tokens TP rank 0 shares; they roll back
        only at the next step, so their tables are still those of this step."""
        sampled = batch.sample_seq_ids
        if get_tp_rank() == 0:  # sampled here: the states hold the new tokens
            self.mtp.share_new_tokens(sampled, result.sampled_token_ids)
            new: dict[int, list[int]] = {}
            tables = {seq_id: self.step_tables.get(seq_id, self.states[seq_id].block_table) for seq_id in sampled}
        else:
            new = self.mtp.share_new_tokens(sampled, None)
            tables = {seq_id: self.states[seq_id].block_table for seq_id in sampled}
        token_ids = {seq_id: self.states[seq_id].token_ids + new[seq_id] if seq_id in new
                     else self.states[seq_id].token_ids for seq_id, _, _, _ in batch.chunks}
        drafts = self.mtp.propose(batch.chunks, batch.positions, batch.meta, hidden, token_ids, tables, sampled)
        if result is not None and sampled:
            result.draft_token_ids = drafts

    def _update_states(self, sched: SchedulerOutput) -> None:
        for seq_id in sched.freed_seq_ids:
            self.states.pop(seq_id, None)
            self.grammar.discard(seq_id)
            self.pooled_rows.discard(seq_id)
            self.prompt_embeds.discard(seq_id)
        for new in sched.new_seqs:
            self.states[new.seq_id] = SeqState(
                list(new.token_ids), new.num_prompt_tokens, list(new.block_table),
                new.num_computed_tokens, new.sampling_params, new.state_slot, new.pooling_params,
            )
            self.states[new.seq_id].lora = new.lora_request
            self.prompt_embeds.add(new.seq_id, new.prompt_embeds)
            self.grammar.add(new.seq_id, new.sampling_params, new.token_ids[new.num_prompt_tokens:])
        self.spec_drafts, self.spec_backups, self.step_tables = {}, {}, {}
        for cached in sched.cached_seqs:
            state = self.states[cached.seq_id]
            state.block_table.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.spec_token_ids:
                self.spec_drafts[cached.seq_id] = cached.spec_token_ids
                self.spec_backups[cached.seq_id] = cached.backup_state_slot

    def _prepare(self, sched: SchedulerOutput) -> BatchInputs:
        """Flat batch: single-token sequences first (batched decode attention), then chunks."""
        counts = sched.num_scheduled_tokens
        order = sorted(counts, key=lambda seq_id: counts[seq_id] != 1)
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        decode_tables, decode_lens, decode_slots, prefills = [], [], [], []
        sample_seq_ids, logits_indices = [], []
        prompt_rows, prompt_indices, prompt_targets, chunks = [], [], [], []
        offset = 0
        for seq_id in order:
            state, n = self.states[seq_id], counts[seq_id]
            drafts = self.spec_drafts.get(seq_id, [])
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            # The scheduler's table covers exactly the tokens up to this step's last: a longer one
            # here means a rollback disagreed with Scheduler.advance.
            assert len(state.block_table) == -(-end // bs), (seq_id, len(state.block_table), end)
            pos = np.arange(start, end)
            table = np.asarray(state.block_table, dtype=np.int64)
            input_ids.append(state.token_ids[start:end] + drafts)  # drafts: after the last known token
            chunks.append((seq_id, offset, n, start))
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
            if end - len(drafts) == len(state.token_ids) and self.samples:
                sample_seq_ids.append(seq_id)
                logits_indices.extend(range(offset + n - 1 - len(drafts), offset + n))
            if state.params.prompt_logprobs is not None:
                # Positions [start, last) predict prompt tokens start + 1 .. last.
                last = min(end, state.num_prompt_tokens - 1)
                if last > start:
                    prompt_rows.append((seq_id, start + 1, last - start))
                    prompt_indices.extend(range(offset, offset + last - start))
                    prompt_targets.extend(state.token_ids[start + 1:last + 1])
            offset += n
        meta = self._attention_metadata(slots, prefills, decode_tables, decode_lens, decode_slots)
        return BatchInputs(
            input_ids=self._tensor(np.fromiter((t for ids in input_ids for t in ids), dtype=np.int64)),
            positions=self._tensor(np.concatenate(positions)),
            meta=meta,
            sample_seq_ids=sample_seq_ids,
            logits_indices=self._tensor(np.asarray(logits_indices, dtype=np.int64)),
            prompt_rows=prompt_rows,
            chunks=chunks,
            prompt_indices=self._tensor(np.asarray(prompt_indices, dtype=np.int64)) if prompt_rows else None,
            prompt_targets=self._tensor(np.asarray(prompt_targets, dtype=np.int64)) if prompt_rows else None,
        )

    def _attention_metadata(self, slots: list[np.ndarray], prefills: list[PrefillChunk], decode_tables: list,
                            decode_lens: list[int], decode_slots: list[int]) -> AttentionMetadata:
        """The step's attention inputs: KV slots of every token, prefill chunks, decode rows."""
        meta = AttentionMetadata(slot_mapping=self._tensor(np.concatenate(slots)), num_decode_tokens=len(decode_lens),
                                 prefills=prefills)
        if decode_lens:
            meta.decode_block_tables = self._tensor(_pad_rows(decode_tables))
            meta.decode_seq_lens = self._tensor(np.asarray(decode_lens, dtype=np.int64))
            meta.decode_state_slots = self._tensor(np.asarray(decode_slots, dtype=np.int64))
        return meta

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _sample(self, seq_ids: list[int], logits: torch.Tensor) -> ModelRunnerOutput:
        """logits [S, V]: one row per sampling sequence, plus one per draft it verifies
        (BatchInputs.logits_indices). Row j of a sequence with drafts [d1..dK] is sampled as if
        d1..dj were its outputs already (penalties, min_tokens, the seed's step); see
        tengyun/spec_decode/verify.py for why that keeps the output distribution."""
        states = [self.states[i] for i in seq_ids]
        drafts = [self.spec_drafts.get(seq_id, []) for seq_id in seq_ids]
        first_row = np.cumsum([0] + [1 + len(d) for d in drafts[:-1]]).tolist()
        bitmask = self.grammar.draft_bitmask(seq_ids, drafts, first_row)
        if not any(drafts):  # one row per sequence: the kept metadata while the same rows sample
            metadata = self.sampling_inputs.metadata(seq_ids, states, bitmask)
        else:
            flat = [row for state, d in zip(states, drafts) for row in _draft_rows(state, d)]  # (params, ids, ids)
            metadata = SamplingMetadata.build([r[0] for r in flat], [r[1] for r in flat], [r[2] for r in flat],
                                              self.vocab_size, self.device, token_bitmask=bitmask)
        return self._collect(seq_ids, states, first_row, self.sampler(logits, metadata))

    def _collect(self, seq_ids: list[int], states: list[SeqState], first_row: list[int],
                 out: SamplerOutput) -> ModelRunnerOutput:
        """Each sequence's new tokens: its accepted drafts and the token after them."""
        result = ModelRunnerOutput()
        sampled = out.sampled_token_ids.tolist()
        lists = (out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.sampled_ranks.tolist()) \
            if out.logprobs is not None else None
        for seq_id, state, row in zip(seq_ids, states, first_row):
            drafts = self.spec_drafts.get(seq_id, [])
            tokens = accepted_tokens(drafts, sampled[row:row + 1 + len(drafts)])
            if drafts:
                self.step_tables[seq_id] = list(state.block_table)
                self._roll_back(state, num_rejected=len(drafts) + 1 - len(tokens), num_new=len(tokens))
            state.token_ids.extend(tokens)
            for token in tokens:
                self.grammar.accept(seq_id, token)
            result.sampled_token_ids[seq_id] = tokens
            if lists is not None and state.params.logprobs is not None:
                k, used = 1 + state.params.logprobs, range(row, row + len(tokens))
                result.logprob_token_ids[seq_id] = [lists[0][r][:k] for r in used]
                result.logprobs[seq_id] = [lists[1][r][:k] for r in used]
                result.sampled_ranks[seq_id] = [lists[2][r] for r in used]
        return result

    def _roll_back(self, state: SeqState, num_rejected: int, num_new: int) -> None:
        """Drop what rejected drafts left, by Scheduler.advance's rule: the blocks past the tokens
        still computed (all but the newest; on a hybrid model with a rejection, the tokens before
        this step, its recurrent state restored to then; a hybrid model's sequences hold state
        slots, also on a pipeline stage without linear-attention layers)."""
        computed = len(state.token_ids) + num_new - 1
        if num_rejected and state.state_slot >= 0:
            if self.state_snapshots.layers:
                self.state_snapshots.restore(state.state_slot)
            computed = state.num_computed_tokens
        del state.block_table[blocks_to_keep(computed, self.block_size):]

    def _collect_prompt_logprobs(self, batch: BatchInputs, logits: torch.Tensor, result: ModelRunnerOutput) -> None:
        """logits [R, V] (raw, as vLLM) of batch.prompt_rows -> one PromptLogprobsChunk per sequence.
        R <= the step's tokens, so memory stays within --max-num-batched-tokens x vocab floats."""
        wanted = {seq_id: self.states[seq_id].params.prompt_logprobs for seq_id, _, _ in batch.prompt_rows}
        max_k = min(max(wanted.values()), self.vocab_size)
        ids, logprobs, ranks = gather_logprobs(logits.float().log_softmax(dim=-1), batch.prompt_targets, max_k)
        ids, logprobs, ranks = ids.tolist(), logprobs.tolist(), ranks.tolist()
        row = 0
        for seq_id, start, count in batch.prompt_rows:
            k, rows = 1 + wanted[seq_id], slice(row, row + count)
            result.prompt_logprobs[seq_id] = PromptLogprobsChunk(
                start, [r[:k] for r in ids[rows]], [r[:k] for r in logprobs[rows]], ranks[rows])
            row += count


def _draft_rows(state: SeqState, drafts: list[int]) -> list[tuple[SamplingParams, list[int], list[int]]]:
    """(params, prompt ids, output ids) of a sequence's sampling rows, one for its last token
    and one per draft: outputs o, drafts [d1, d2] -> outputs o, o + [d1], o + [d1, d2]."""
    prompt, outputs = state.token_ids[: state.num_prompt_tokens], state.token_ids[state.num_prompt_tokens:]
    return [(state.params, prompt, outputs + drafts[:j]) for j in range(1 + len(drafts))]


def _no_grammar_compiler() -> Any:
    raise ValueError("This model runner was built without a grammar compiler: structured output is unavailable.")


def _pad_rows(rows: list[np.ndarray]) -> np.ndarray:
    """[[3, 7], [5]] -> [[3, 7], [5, 0]]"""
    out = np.zeros((len(rows), max(len(r) for r in rows)), dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out
