"""ngram speculative decoding end to end on a tiny random Llama: the same tokens as without it
(greedy, and seeded sampling with every filter), with continuous batching, chunked prefill,
prefix caching and preemption; stops inside accepted drafts; rejected drafts' KV rolled back.

A random model rarely repeats itself, so most tests bias tokens 7 and 9 (logit_bias): the
target then often continues a run of them, which prompt lookup drafts, and as often does not
(the drafts are rejected)."""

from __future__ import annotations

import pytest

from tengyun import LLM, SamplingParams
from tengyun.config import EngineConfig
from tengyun.engine.scheduler import Scheduler
from tengyun.engine.sequence import Sequence
from tengyun.spec_decode.drafter import Drafter

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[5, 17, 29, 41, 5, 17, 29, 41, 5, 17], [7, 7, 9, 7, 7, 9, 7], list(range(10, 60)),
           [100, 101, 102, 103, 104, 105], [7, 7, 9, 7, 7, 9, 7], [9, 9, 9, 9, 9, 2, 9]]
BIAS = {7: 6.0, 9: 6.0}
# 24 blocks of 8 tokens for 6 sequences of up to 90 tokens: some are preempted and recomputed;
# 16 tokens a step: the 50-token prompt is prefilled in chunks, batched with others' decodes.
SMALL = dict(block_size=8, max_model_len=128, num_gpu_blocks_override=24, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def pair(tiny_checkpoints):
    """(without speculation, with ngram speculation), otherwise the same engine."""
    path = str(tiny_checkpoints["llama"])
    return LLM(path, **SMALL), LLM(path, speculative_config=NGRAM, **SMALL)


def _generate(llm, params):
    return [o.outputs[0] for o in llm.generate(PROMPTS, params)]


def _stats(llm):
    return llm.llm_engine.scheduler.spec_stats.snapshot()


def test_greedy_tokens_identical_with_and_without_speculation(pair):
    base, spec = pair
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logit_bias=BIAS if i % 3 else None)
              for i in range(len(PROMPTS))]
    before = _stats(spec)
    expected = _generate(base, params)
    got = _generate(spec, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    stats, engine_stats = _stats(spec), spec.llm_engine.get_stats()
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    drafted = stats.num_draft_tokens - before.num_draft_tokens
    assert 0 < accepted < drafted  # drafts both accepted and rejected
    assert stats.num_accepted_tokens_per_pos[2] > before.num_accepted_tokens_per_pos[2]  # whole drafts held
    assert engine_stats.num_preemptions > 0 and engine_stats.prefix_cache_hits > 0
    assert (engine_stats.num_running, engine_stats.kv_cache_usage) == (0, 0.0)


def test_seeded_sampling_with_filters_penalties_and_logprobs_is_unchanged(pair):
    """Each verified position is sampled as a plain step would (spec_decode/verify.py): a seeded
    request draws the same tokens, with the same logprobs, speculation or not."""
    base, spec = pair
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.01, repetition_penalty=1.1,
                            presence_penalty=0.2, frequency_penalty=0.1, seed=11, logprobs=3, max_tokens=30,
                            ignore_eos=True, logit_bias=BIAS)
    before = _stats(spec)
    expected, got = _generate(base, params), _generate(spec, params)
    assert _stats(spec).num_accepted_tokens > before.num_accepted_tokens
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
        assert g.cumulative_logprob == pytest.approx(e.cumulative_logprob, abs=1e-3)
        for e_step, g_step in zip(e.logprobs, g.logprobs):
            assert list(g_step) == list(e_step)
            assert [x.logprob for x in g_step.values()] == pytest.approx([x.logprob for x in e_step.values()],
                                                                        abs=1e-4)


@pytest.mark.parametrize("stop", [dict(stop_token_ids=[9]), dict(stop=["x"]), dict(max_tokens=5),
                                  dict(min_tokens=6, stop_token_ids=[9])])
def test_a_stop_inside_accepted_drafts_ends_the_output_there(pair, stop):
    base, spec = pair
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 24, "ignore_eos": True,
                               "logit_bias": {7: 8.0, 9: 7.0}, **stop})
    for e, g in zip(_generate(base, params), _generate(spec, params)):
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == \
            (e.token_ids, e.text, e.finish_reason, e.stop_reason)
    assert spec.llm_engine.get_stats().kv_cache_usage == 0.0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_structured_output_with_drafts_keeps_its_grammar(pair, temperature):
    """Each draft row is masked for the grammar's state after the drafts before it (the matcher
    steps through them and rolls back): the same text as without speculation, drafts accepted
    and rejected."""
    import re

    from tengyun.sampling_params import StructuredOutputsParams

    base, spec = pair
    pattern = "(ab|cd|abab){3,9}x"
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    before = _stats(spec)
    expected, got = _generate(base, params), _generate(spec, params)
    assert [o.text for o in got] == [o.text for o in expected]
    assert all(re.fullmatch(pattern, o.text) for o in got)
    stats = _stats(spec)
    assert stats.num_accepted_tokens > before.num_accepted_tokens
    assert stats.num_draft_tokens - before.num_draft_tokens > stats.num_accepted_tokens - before.num_accepted_tokens


def _scheduler(num_state_slots: int = 0, **overrides) -> Scheduler:
    config = EngineConfig(block_size=2, max_model_len=64, max_num_batched_tokens=64, speculative_config=NGRAM,
                          **overrides)
    return Scheduler(config, num_blocks=32, num_state_slots=num_state_slots, drafter=Drafter.from_config(config))


def _decoding(scheduler: Scheduler, seq_id: int, prompt: list[int]) -> Sequence:
    """A sequence whose prompt ran and whose first output is the prompt's first token."""
    seq = Sequence(seq_id, str(seq_id), 0, prompt, SamplingParams(max_tokens=20), arrival_order=seq_id)
    scheduler.add(seq)
    scheduler.advance(scheduler.schedule(), {seq_id: seq}, {seq_id: [prompt[0]]})
    seq.append_token(prompt[0])
    return seq


def test_hybrid_drafts_borrow_a_spare_state_slot_that_waiting_sequences_cannot_use():
    scheduler = _scheduler(num_state_slots=3, max_num_seqs=3)
    pool = scheduler.state_pool
    first = _decoding(scheduler, 0, [1, 2, 1, 2, 1])
    step = scheduler.schedule()  # 2 of 3 slots free, nothing waits: a backup slot for the drafts
    assert step.cached_seqs[0].spec_token_ids and step.cached_seqs[0].backup_state_slot == 1
    assert pool.num_free == 1
    scheduler.advance(step, {0: first}, {0: [7]})  # rejected: nothing of the step counts, backup back
    first.append_token(7)
    assert pool.num_free == 2 and first.num_computed_tokens == 5
    scheduler.add(Sequence(1, "1", 0, [3, 4], SamplingParams(max_tokens=20), arrival_order=1))
    scheduler.add(Sequence(2, "2", 0, [5, 6], SamplingParams(max_tokens=20), arrival_order=2))
    step = scheduler.schedule()  # two wait for the two free slots: no backup, no drafts
    assert [c.spec_token_ids for c in step.cached_seqs] == [[]] and pool.num_free == 0


def test_rejected_drafts_free_their_blocks_and_stay_out_of_the_prefix_cache():
    scheduler = _scheduler()
    bm = scheduler.block_manager
    seq = Sequence(0, "r", 0, [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=20), arrival_order=0)
    scheduler.add(seq)
    seqs = {0: seq}
    first = scheduler.schedule()  # the prompt: 8 tokens, 4 blocks
    scheduler.advance(first, seqs, {0: [3]})
    seq.append_token(3)
    step = scheduler.schedule()  # suffix [1, 2, 3] first seen at 0 -> drafts [1, 2, 3]
    assert step.cached_seqs[0].spec_token_ids == [1, 2, 3] and step.num_scheduled_tokens == {0: 4}
    assert len(seq.block_table) == 6  # positions 8..11: the last token and three drafts
    assert len(bm.hash_to_block) == 4  # blocks of verified tokens only: [1,2] [3,1] [2,3] [1,2]
    free_before, tail = bm.num_free_blocks, seq.block_table[5]
    scheduler.advance(step, seqs, {0: [1, 5]})  # draft 1 accepted, 2 and 3 rejected, then 5
    assert seq.num_computed_tokens == 10  # prompt, 3, and the accepted 1
    assert len(seq.block_table) == 5 and bm.num_free_blocks == free_before + 1
    assert next(iter(bm.free_queue)) == tail  # the rolled-back block is reused first
    assert len(bm.hash_to_block) == 4
    stats = scheduler.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
            stats.num_accepted_tokens_per_pos) == (1, 3, 1, [1, 0, 0])


def test_drafts_stop_short_of_max_tokens_and_the_step_budget():
    scheduler = _scheduler(max_num_seqs=4)
    seq = Sequence(0, "r", 0, [4, 4, 4, 4, 4], SamplingParams(max_tokens=3), arrival_order=0)
    scheduler.add(seq)
    scheduler.advance(scheduler.schedule(), {0: seq}, {0: [4]})
    seq.append_token(4)
    # 2 more outputs allowed: one drafted token plus the one the step samples anyway
    assert scheduler.schedule().cached_seqs[0].spec_token_ids == [4]
