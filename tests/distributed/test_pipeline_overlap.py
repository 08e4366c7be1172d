"""Overlapped pipeline stages with real worker processes over gloo: with two batches in flight,
greedy tokens equal one process's token for token, under preemption (a tiny KV cache), prefix
hits, a stop token, and an abort of a request whose batch is still running."""

from __future__ import annotations

import random

import pytest

from tengyun import LLM, SamplingParams

ENGINE_ARGS = dict(block_size=8, max_model_len=104, num_gpu_blocks_override=13,  # preemption must happen
                   max_num_batched_tokens=32, max_num_seqs=16)
MAX_TOKENS = 10


def _prompts() -> list[list[int]]:
    """6 prompts of 3..70 tokens, three sharing a 20-token prefix; two longer than the 32-token budget."""
    rng = random.Random(1)
    shared = [rng.randrange(1, 300) for _ in range(20)]
    prompts = [[rng.randrange(1, 300) for _ in range(n)] for n in (3, 40, 70)]
    return prompts + [shared + [rng.randrange(1, 300) for _ in range(n)] for n in (4, 9, 15)]


def _run(llm: LLM, params: list[SamplingParams], abort_after: int | None = None) -> tuple[dict, int]:
    """Drive the engine step by step: ({request id: (tokens, finish reason)}, steps that returned
    with a batch still in flight). From step ``abort_after`` on, abort the first request found in a running batch."""
    engine = llm.llm_engine
    for i, (prompt, p) in enumerate(zip(_prompts(), params)):
        engine.add_request(str(i), prompt, p)
    done, steps, overlapped = {}, 0, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = (output.outputs[0].token_ids, str(output.outputs[0].finish_reason))
        steps += 1
        overlapped += bool(engine._in_flight)
        if abort_after is not None and steps >= abort_after and engine._in_flight:
            abort_after = None
            in_flight = engine._in_flight[0].num_scheduled_tokens
            engine.abort_request(engine.seqs[next(iter(in_flight))].request_id)
    return done, overlapped


def _greedy(stop_token_ids: list[int] | None = None) -> list[SamplingParams]:
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True) for _ in _prompts()]
    if stop_token_ids:
        params[3] = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                   stop_token_ids=stop_token_ids)
    return params


def _llm(folder, **kwargs) -> LLM:
    return LLM(str(folder), dtype="float32", **ENGINE_ARGS, **kwargs)


_reference: dict = {}


def _single_process(folder, **kwargs) -> dict:
    key = (folder, tuple(sorted(kwargs.items())))
    if key not in _reference:
        _reference[key] = _run(_llm(folder, **kwargs), _greedy())[0]
    return _reference[key]


@pytest.mark.parametrize("arch,pp,extra", [
    ("llama", 2, {}),
    ("qwen3", 2, {}),
    # Hybrid (Gated DeltaNet state slots) overlaps without prefix caching (with it: one batch, below).
    ("qwen3_5", 2, {"enable_prefix_caching": False}),
    ("qwen3_5", 4, {"enable_prefix_caching": False}),  # 4 layers: one per stage
])
def test_overlapped_pipeline_greedy_matches_single_process(tiny_checkpoints, tiny_hybrid_checkpoints, arch, pp,
                                                           extra):
    folder = {**tiny_checkpoints, **tiny_hybrid_checkpoints}[arch]
    reference = _single_process(folder, **extra)
    stop = reference["3"][0][4]  # request 3 stops at its 5th token (or earlier, where it recurs)
    llm = _llm(folder, pipeline_parallel_size=pp, **extra)
    try:
        assert llm.llm_engine.batches_in_flight == pp
        got, overlapped = _run(llm, _greedy([stop]))
        stats = llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.shutdown()
    assert overlapped > 0
    assert stats.num_preemptions > 0
    if extra.get("enable_prefix_caching", True):
        assert stats.prefix_cache_hits > 0
    want_3 = reference["3"][0][:reference["3"][0].index(stop) + 1]
    assert got.pop("3") == (want_3, "stop")
    assert got == {k: v for k, v in reference.items() if k != "3"}


def test_abort_while_its_batch_runs_leaves_the_others_exact(tiny_checkpoints):
    folder = tiny_checkpoints["llama"]
    reference = _single_process(folder)
    llm = _llm(folder, pipeline_parallel_size=2)
    try:
        got, _ = _run(llm, _greedy(), abort_after=3)
        again, _ = _run(llm, _greedy())  # the workers' state agrees with the engine's after the abort
        usage = llm.llm_engine.get_stats().kv_cache_usage
    finally:
        llm.llm_engine.shutdown()
    aborted = [k for k, (_, reason) in got.items() if reason == "abort"]
    assert len(aborted) == 1
    assert {k: v for k, v in got.items() if k not in aborted} == \
        {k: v for k, v in reference.items() if k not in aborted}
    assert again == reference and usage == 0.0


def test_overlap_off_or_hybrid_prefix_caching_runs_one_batch_at_a_time(tiny_checkpoints, tiny_hybrid_checkpoints):
    folder = tiny_checkpoints["llama"]
    llm = _llm(folder, pipeline_parallel_size=2, disable_pipeline_overlap=True)
    try:
        assert llm.llm_engine.batches_in_flight == 1
        got, overlapped = _run(llm, _greedy())
    finally:
        llm.llm_engine.shutdown()
    assert overlapped == 0 and got == _single_process(folder)
    hybrid = _llm(tiny_hybrid_checkpoints["qwen3_5"], pipeline_parallel_size=2)
    try:
        assert hybrid.llm_engine.batches_in_flight == 1  # state snapshots: one step in flight
    finally:
        hybrid.llm_engine.shutdown()


def test_server_loop_overlaps_and_streams_pp1s_tokens(tiny_checkpoints):
    """The server's engine loop (AsyncLLMEngine) over PP 2 with overlap: concurrent streamed
    requests get PP 1's tokens; one cancelled mid-stream is aborted, the rest unaffected."""
    import asyncio

    from tengyun.engine.async_engine import AsyncLLMEngine

    folder = tiny_checkpoints["llama"]
    reference = _single_process(folder)
    llm = _llm(folder, pipeline_parallel_size=2)
    engine = AsyncLLMEngine(llm.llm_engine)

    async def collect(i: int, cancel_after: int | None) -> list[int]:
        tokens = []
        async for out in engine.generate(f"s{i}", _prompts()[i], _greedy()[i]):
            tokens = out.outputs[0].token_ids
            if cancel_after is not None and len(tokens) >= cancel_after:
                break  # the stream closes: the engine aborts the request
        return tokens

    async def main():
        engine.start()
        try:
            return await asyncio.gather(*(collect(i, 3 if i == 2 else None) for i in range(len(_prompts()))))
        finally:
            engine.shutdown()

    try:
        results = asyncio.run(main())
        stats = llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.shutdown()
    assert len(results[2]) < MAX_TOKENS
    assert {str(i): r for i, r in enumerate(results) if i != 2} == \
        {k: tokens for k, (tokens, _) in reference.items() if k != "2"}
    assert llm.llm_engine.batches_in_flight == 2 and stats.kv_cache_usage == 0.0
