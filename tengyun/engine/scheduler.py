"""Scheduler: token-budget continuous batching with chunked prefill and preemption by recompute."""

from __future__ import annotations

import bisect
from collections import deque

from tengyun.config import EngineConfig
from tengyun.engine.block_manager import BlockManager
from tengyun.engine.messages import CachedSeqData, NewSeqData, SchedulerOutput
from tengyun.engine.sequence import Sequence, SequenceStatus
from tengyun.engine.state_pool import StatePool
from tengyun.engine.state_snapshots import StateSnapshots
from tengyun.spec_decode.drafter import Drafter


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, num_state_slots: int = 0, num_state_snapshots: int = 0,
                 drafter: Drafter | None = None, batches_in_flight: int = 1):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        # LoRA: at most this many adapters in one step (the worker's --max-loras slots).
        self.max_loras = config.max_loras if getattr(config, "enable_lora", False) else 0
        self._step_loras: set[int] = set()  # lora_int_id of the adapters this step runs so far
        self.chunked_prefill = config.enable_chunked_prefill
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        # Hybrid models: a sequence runs only while it holds a recurrent-state slot too.
        self.state_pool = StatePool(num_state_slots) if num_state_slots else None
        # ... and with prefix caching, a hit restores the state kept at its last block (no rows:
        # no hits; the KV blocks alone would resume from another sequence's state).
        self.snapshots: StateSnapshots | None = None
        if num_state_slots and config.enable_prefix_caching:
            self.snapshots = StateSnapshots(num_state_snapshots, config.block_size)
            self.block_manager.on_evict = self.snapshots.evict
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival_order; the last is preempted first
        self.parked: dict[int, Sequence] = {}  # beam search: beams that reported their round (park)
        self._seqs_on_worker: set[int] = set()
        self._freed_seq_ids: list[int] = []
        self.num_preemptions = 0
        # Pipeline parallel (llm_engine.py): up to this many scheduled batches run at once; a
        # sequence in one of them (in _in_flight from schedule to advance) is in no other.
        self.batches_in_flight = batches_in_flight
        self._in_flight: set[int] = set()
        # Speculative decoding (ngram): drafts proposed here, verified by the worker in one step.
        self.drafter = drafter
        self.spec_stats = drafter.stats if drafter else None

    # ----- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence behind every waiting one whose turn is not later, so requests take
        turns: with A's turns [0, 1, 2, 3] waiting, B's turn 0 goes in as [A0, B0, A1, A2, A3],
        and one request with n=128 cannot hold back a later request with n=1. Preempted
        sequences (put back in front) count as turn -1: nothing new passes them."""
        i = len(self.waiting)
        while i and self._waiting_turn(self.waiting[i - 1]) > seq.turn:
            i -= 1
        self.waiting.insert(i, seq)

    @staticmethod
    def _waiting_turn(seq: Sequence) -> int:
        return -1 if seq.num_preemptions else seq.turn

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.parked.pop(seq.seq_id, None)
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)
        self._free_state(seq)
        self._forget_on_worker(seq)

    def park(self, seq: Sequence) -> None:
        """Beam search: take a running beam that reported its round out of the schedule, its
        blocks kept until the beams forked from it hold them too (finish frees them), or until
        blocks run out (_drop_parked)."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PARKED
        self.parked[seq.seq_id] = seq
        self._forget_on_worker(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Beam search: ``child`` (parent's tokens plus one) runs next, sharing parent's blocks and
        KV: it computes only its last token. The worker learns of it when it is first scheduled.
        A parent whose blocks were dropped forks a child that recomputes, as a preempted one."""
        if not parent.block_table:
            child.num_preemptions = 1  # ahead of new requests (Scheduler.add)
            self.add(child)
            return
        self.block_manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = SequenceStatus.RUNNING
        bisect.insort(self.running, child, key=lambda s: s.arrival_order)

    def _drop_parked(self) -> bool:
        """Free the blocks of the latest parked beam (its children will recompute), when blocks
        run out: parked beams hold blocks but cannot be preempted. False when none is left."""
        holding = [seq for seq in self.parked.values() if seq.block_table]
        if not holding:
            return False
        seq = max(holding, key=lambda s: s.arrival_order)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        self.num_preemptions += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Running sequences first, in arrival order, then waiting ones while budget lasts.

        Each gets min(its uncomputed tokens, remaining budget): a decode is 1 token, a prompt
        may be split into chunks over several steps. When blocks run out the latest-arrived
        running sequence is preempted (blocks freed, recomputed later).

        With batches in flight, sequences in one are left out (and never preempted), and a batch
        takes at most its share of the unfinished sequences, so the batches stay about equal:
        64 sequences, 2 in flight -> 32 each. An empty output keeps the freed ids for the next.
        """
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._step_loras = set()
        max_seqs = -(-(len(self.running) + len(self.waiting)) // self.batches_in_flight)
        preempted = self._schedule_running(out, budget, max_seqs)
        budget -= out.total_num_scheduled_tokens
        if not preempted:
            self._schedule_waiting(out, budget, max_seqs)
        if out.is_empty:
            return out
        self._in_flight.update(out.num_scheduled_tokens)
        out.freed_seq_ids, self._freed_seq_ids = self._freed_seq_ids, []
        if self.snapshots is not None:
            out.state_restores, out.state_saves = self.snapshots.take_copies()
        out.block_copies = self.block_manager.take_copies()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, max_seqs: int) -> bool:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0 and len(out.num_scheduled_tokens) < max_seqs:
            seq = self.running[i]
            if seq.seq_id in self._in_flight:
                i += 1
                continue
            if not self._lora_fits(seq):  # --max-loras other adapters run this step: it waits a step
                i += 1
                continue
            num_new = self._align(seq, seq.num_computed_tokens, min(seq.num_uncomputed_tokens, budget))
            drafts = self._drafts_for(seq, num_new, budget)
            num_new += len(drafts)
            while not self.block_manager.can_allocate(seq, num_new):
                if self._drop_parked():
                    continue
                # The latest-arrived not in flight: seq itself at the latest, so at index >= i.
                victim = next(s for s in reversed(self.running) if s.seq_id not in self._in_flight)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            num_blocks_before = len(seq.block_table)
            # Hybrid models roll a rejected step back whole (advance): none of its tokens is verified yet.
            unverified = num_new if drafts and self.state_pool is not None else len(drafts)
            self.block_manager.allocate(seq, num_new, num_unverified=unverified)
            seq.spec_token_ids = drafts
            backup = self.state_pool.allocate(_backup_key(seq)) if drafts and self.state_pool is not None else -1
            if not drafts:  # a step with drafts ends on unverified tokens: no snapshot of its state
                self._save_state(seq, num_new)
            if seq.seq_id in self._seqs_on_worker:
                out.cached_seqs.append(CachedSeqData(seq.seq_id, seq.block_table[num_blocks_before:],
                                                     seq.num_computed_tokens, drafts, backup))
            else:  # a forked beam (fork): new to the worker, its tokens but the last already in KV
                out.new_seqs.append(NewSeqData(seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens,
                                               list(seq.block_table), seq.num_computed_tokens, seq.sampling_params,
                                               lora_request=seq.lora_request))
                self._seqs_on_worker.add(seq.seq_id)
            out.num_scheduled_tokens[seq.seq_id] = num_new
            budget -= num_new
            self._note_lora(seq)
            i += 1
        return preempted

    def _drafts_for(self, seq: Sequence, num_new: int, budget: int) -> list[int]:
        """Drafts to verify after the sequence's uncomputed tokens: only when all of them fit (a
        decode, or on hybrid models the recompute after a rejection, see advance), their blocks
        are free, and on hybrid models a state slot waiting sequences cannot use is free for the
        copy of its state the worker restores on a rejection."""
        if (self.drafter is None or num_new != seq.num_uncomputed_tokens
                or seq.num_computed_tokens < seq.num_prompt_tokens):
            return []
        drafts = self.drafter.propose(seq, budget)
        if not drafts or not self.block_manager.can_allocate(seq, num_new + len(drafts)):
            return []
        pool = self.state_pool
        if pool is not None and pool.num_free <= min(len(self.waiting), self.max_num_seqs - len(self.running)):
            return []
        return drafts

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, max_seqs: int) -> None:
        skipped: list[Sequence] = []  # waiting for an adapter slot: back in front, in order, at the end
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and len(out.num_scheduled_tokens) < max_seqs):
            seq = self.waiting[0]
            if not self._lora_fits(seq):  # its adapter would be one too many this step: later ones pass
                skipped.append(self.waiting.popleft())
                continue
            cached_blocks = self.block_manager.find_cached_blocks(seq)
            kv_hit_tokens = len(cached_blocks) * self.block_manager.block_size
            if self.snapshots is not None:  # a hybrid hit needs the recurrent state at its end too
                hit = self.snapshots.trim_hit(seq, cached_blocks)
                if self.snapshots.writes_longer_hit(seq, len(hit), len(cached_blocks)):
                    break  # a longer hit is being written this step: take it next step
                cached_blocks = hit
            num_cached = len(cached_blocks) * self.block_manager.block_size
            num_new = seq.num_tokens - num_cached
            if num_new > budget:
                if not self.chunked_prefill:
                    break
                num_new = budget
            num_new = self._align(seq, num_cached, num_new, kv_hit_tokens)
            if not self.block_manager.can_allocate(seq, num_new, cached_blocks):
                if not self.running and self._drop_parked():  # else running ones will free blocks
                    continue
                break
            if self.state_pool is not None and not self.state_pool.can_allocate():
                break
            self.waiting.popleft()
            if seq.uses_prefix_cache:
                self.block_manager.record_prefix_lookup(seq.num_tokens, num_cached)
            self.block_manager.allocate(seq, num_new, cached_blocks)
            seq.num_computed_tokens = num_cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival_order)
            slot = self.state_pool.allocate(seq.seq_id) if self.state_pool is not None else -1
            if self.snapshots is not None and cached_blocks:
                self.snapshots.restore(seq, len(cached_blocks), slot)
            self._save_state(seq, num_new)
            out.new_seqs.append(
                NewSeqData(seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens,
                           list(seq.block_table), num_cached, seq.sampling_params, slot, seq.pooling_params,
                           lora_request=seq.lora_request, prompt_embeds=seq.prompt_embeds)
            )
            self._seqs_on_worker.add(seq.seq_id)
            out.num_scheduled_tokens[seq.seq_id] = num_new
            budget -= num_new
            self._note_lora(seq)
        self.waiting.extendleft(reversed(skipped))

    def _lora_fits(self, seq: Sequence) -> bool:
        """Whether ``seq`` may run this step: base-model sequences always, an adapter's while this
        step runs it already or fewer than --max-loras adapters."""
        lora = seq.lora_request
        return lora is None or lora.lora_int_id in self._step_loras or len(self._step_loras) < self.max_loras

    def _note_lora(self, seq: Sequence) -> None:
        if seq.lora_request is not None:
            self._step_loras.add(seq.lora_request.lora_int_id)

    def _align(self, seq: Sequence, start: int, num_new: int, kv_hit_tokens: int = 0) -> int:
        """Hybrid prefix caching: end prefill chunks where a state snapshot can be kept."""
        if self.snapshots is None:
            return num_new
        return self.snapshots.align_chunk(seq, start, num_new, kv_hit_tokens)

    def _save_state(self, seq: Sequence, num_new: int) -> None:
        """After allocate (the chunk's full blocks are hashed): snapshot at the chunk's end if useful."""
        if self.snapshots is not None:
            self.snapshots.save_after(seq, self.state_pool.slot_of(seq.seq_id), seq.num_computed_tokens, num_new)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._free_state(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids, seq.proposed_token_ids = [], []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        self._forget_on_worker(seq)

    def _free_state(self, seq: Sequence) -> None:
        if self.state_pool is not None:
            self.state_pool.free(seq.seq_id)

    def _forget_on_worker(self, seq: Sequence) -> None:
        if seq.seq_id in self._seqs_on_worker:
            self._seqs_on_worker.discard(seq.seq_id)
            self._freed_seq_ids.append(seq.seq_id)

    # ----- after the model ran ------------------------------------------------------------
    def advance(self, out: SchedulerOutput, seqs: dict[int, Sequence],
                sampled: dict[int, list[int]] | None = None) -> None:
        """Count this step's tokens as computed, less the rejected drafts: a sequence that
        verified K drafts and got back ``sampled`` [d1, ..., da, x] keeps KV for its last token
        and d1..da, and frees the blocks past them. On hybrid models (a state pool) a rejection
        counts none of the step's tokens: the worker restored the recurrent state of before the
        step, so they are recomputed, accepted drafts included, with the next step's. A
        sequence aborted while its batch ran is gone (or finished) and skipped."""
        for seq_id, num_new in out.num_scheduled_tokens.items():
            self._in_flight.discard(seq_id)
            seq = seqs.get(seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            computed_before = seq.num_computed_tokens
            seq.num_computed_tokens += num_new
            if seq.spec_token_ids:
                num_accepted = len(sampled[seq_id]) - 1
                num_rejected = len(seq.spec_token_ids) - num_accepted
                seq.num_computed_tokens -= num_rejected
                if self.state_pool is not None:
                    self.state_pool.free(_backup_key(seq))
                    if num_rejected:
                        seq.num_computed_tokens = computed_before
                self.spec_stats.record(len(seq.spec_token_ids), num_accepted)
                self.block_manager.roll_back(seq)
                seq.spec_token_ids = []
        if self.snapshots is not None:
            self.snapshots.commit()


def _backup_key(seq: Sequence) -> int:
    """The StatePool key of the slot holding a copy of seq's recurrent state during a verification
    step (negative: never a sequence id)."""
    return -1 - seq.seq_id
