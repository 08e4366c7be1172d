"""Prefix caching on hybrid models (Qwen3.5, Qwen3.5-MoE; Qwen3-Next in test_qwen3_next.py): prompts
sharing a prefix, a second turn that extends a first, under chunked prefill, preemption and a KV
budget that holds four sequences, give HF transformers' greedy tokens and logprobs, with hits in
the tengyun:prefix_cache_hits metric; and a hypothesis state machine of random add / step / abort
on a real engine whose every finished sequence equals the prefix-cache-off engine's."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import make_tiny_qwen3_5
from test_hf_parity import TOP_K
from test_qwen3_5 import _assert_matches, _hf_reference
from tengyun import LLM, SamplingParams
from tengyun.entrypoints.openai.metrics import EngineMetrics

# Per slot (fp32): 3 linear layers x (64 x 3 conv + 4 x 8 x 8 SSM) x 4 B = 5,376 B, doubled by its
# snapshot row; a block of 8 tokens: 1 attention layer x 2 x 2 heads x 16 x 4 B x 8 = 2 KiB.
# 74 KiB -> 4 slots + 4 snapshots (42 KiB) and 16 blocks (128 tokens) for ~470 tokens of demand.
SMALL_BUDGET = dict(block_size=8, max_model_len=96, kv_cache_memory="74KiB", max_num_seqs=4,
                    max_num_batched_tokens=16)


def _turns(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Round 1: four prompts on a 27-token shared prefix (3 blocks and a bit) and one unrelated;
    round 2: two new suffixes on the prefix and the same prompt again (its tail differs in length)."""
    rng = random.Random(1)
    words = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731
    shared = words(27)
    first = [shared + words(n) for n in (4, 13, 21, 1)] + [words(40)]
    second = [shared + words(9), first[1][:35] + words(20), list(first[2])]
    return first, second


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_shared_prefixes_match_hf_with_hits_under_chunking_preemption_and_a_small_budget(
        tiny_hybrid_checkpoints, arch):
    first, second = _turns(300)
    hf = make_tiny_qwen3_5(arch)
    llm = LLM(str(tiny_hybrid_checkpoints[arch]), dtype="float32", **SMALL_BUDGET)
    engine = llm.llm_engine
    assert (engine.scheduler.state_pool.num_slots, engine.scheduler.snapshots.num_rows) == (4, 4)
    assert engine.scheduler.block_manager.num_blocks == 16
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=TOP_K)
    metrics = EngineMetrics(engine.config)
    metrics.start_from(engine.get_stats())
    _assert_matches(llm.generate(first, params), _hf_reference(hf, first, 10))
    hits_in_first_round = engine.get_stats().prefix_cache_hits
    _assert_matches(llm.generate(second, params), _hf_reference(hf, second, 10))
    stats = engine.get_stats()
    metrics.on_step([], stats)
    hits = {s.name: s.value for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
            for s in f.samples}["tengyun:prefix_cache_hits_total"]
    assert hits == stats.prefix_cache_hits > hits_in_first_round > 0
    assert stats.num_preemptions > 0
    assert stats.kv_cache_usage == 0.0 and engine.scheduler.state_pool.num_free == 4


class CachedStatesStayIntact(RuleBasedStateMachine):
    """Random requests on shared prefixes (and repeats of earlier prompts) added, stepped and
    aborted on one engine with prefix caching, its cache kept from example to example; every
    sequence that finishes must have the tokens the prefix-cache-off engine gives its prompt."""

    cached: LLM
    reference: LLM
    request_ids = itertools.count()
    expected: dict[tuple[int, ...], list[int]]
    prefixes: list[list[int]]

    @initialize()
    def start(self):
        self.engine = self.cached.llm_engine
        self.engine.abort_request(list(self.engine.requests))  # left by a failed example
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.prompts: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}

    @rule(prefix=st.integers(0, 3), suffix=st.lists(st.integers(1, 299), min_size=1, max_size=16),
          max_tokens=st.integers(1, 10))
    def add(self, prefix, suffix, max_tokens):
        self._add((self.prefixes[prefix] if prefix < 3 else []) + suffix, max_tokens)

    @rule(pick=st.integers(0, 50))
    def add_an_earlier_prompt(self, pick):
        if self.prompts:
            self._add(list(self.prompts.values())[pick % len(self.prompts)], 10)

    def _add(self, prompt, max_tokens):
        request_id = f"r{next(self.request_ids)}"  # unique over examples: one engine serves them all
        self.prompts[request_id], self.max_tokens[request_id] = prompt, max_tokens
        self.engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                   ignore_eos=True))

    @rule(steps=st.integers(1, 6))
    def step(self, steps):
        for _ in range(steps):
            self._check(self.engine.step())

    @rule(pick=st.integers(0, 50))
    def abort(self, pick):
        live = list(self.engine.requests)
        if live:
            self.engine.abort_request(live[pick % len(live)])

    def _check(self, outputs):
        for out in outputs:
            if out.finished and out.outputs[0].finish_reason != "abort":
                prompt, n = self.prompts[out.request_id], self.max_tokens[out.request_id]
                assert out.outputs[0].token_ids == self._expected(prompt)[:n], f"{out.request_id} {prompt}"

    def _expected(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self.expected:
            params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
            self.expected[key] = self.reference.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        return self.expected[key]

    @invariant()
    def running_sequences_hold_distinct_slots(self):
        slots = [self.engine.scheduler.state_pool.slot_of(s.seq_id) for s in self.engine.scheduler.running]
        assert len(set(slots)) == len(slots)

    def teardown(self):
        while self.engine.has_unfinished_requests():
            self._check(self.engine.step())


def test_cached_states_are_never_corrupted(tiny_hybrid_checkpoints):
    folder = str(tiny_hybrid_checkpoints["qwen3_5"])
    rng = random.Random(2)
    shared = [rng.randrange(1, 300) for _ in range(20)]
    # 34 KiB at max_model_len 48: 2 slots + 2 snapshots and 6 blocks (48 tokens) for two sequences
    # of up to 46 tokens.
    CachedStatesStayIntact.cached = LLM(folder, dtype="float32", **{
        **SMALL_BUDGET, "max_model_len": 48, "kv_cache_memory": "34KiB", "max_num_seqs": 2})
    sched = CachedStatesStayIntact.cached.llm_engine.scheduler
    assert (sched.state_pool.num_slots, sched.snapshots.num_rows, sched.block_manager.num_blocks) == (2, 2, 6)
    CachedStatesStayIntact.reference = LLM(folder, dtype="float32", block_size=8, max_model_len=48,
                                           enable_prefix_caching=False, kv_cache_memory="1MiB")
    CachedStatesStayIntact.expected = {}
    CachedStatesStayIntact.prefixes = [shared[:8], shared, shared[:13] + [rng.randrange(1, 300) for _ in range(9)]]
    run_state_machine_as_test(CachedStatesStayIntact, settings=settings(max_examples=12, stateful_step_count=25,
                                                                        deadline=None))
    stats = CachedStatesStayIntact.cached.llm_engine.get_stats()
    for llm in (CachedStatesStayIntact.cached, CachedStatesStayIntact.reference):  # class attributes outlive the test
        llm.llm_engine.shutdown()
    del CachedStatesStayIntact.cached, CachedStatesStayIntact.reference
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
