"""Prompt logprobs equal HF transformers' log_softmax over the prompt's forward pass, under
chunked prefill, forced preemption and prefix caching (no hit for the requests that ask), on
tiny random checkpoints (fp32); and the same numbers under TP x PP worker processes."""

from __future__ import annotations

import random

import pytest
import torch

from tengyun import LLM, SamplingParams

TOP_N = 5
ENGINE_ARGS = dict(block_size=8, max_model_len=104, max_num_seqs=16,
                   num_gpu_blocks_override=13,  # 104 slots for ~700 tokens of demand: preemption must happen
                   max_num_batched_tokens=16)  # prompts of up to 90 tokens arrive in chunks


def _prompts() -> list[list[int]]:
    """8 prompts of 2..90 tokens; the last four share a 40-token prefix."""
    rng = random.Random(3)
    shared = [rng.randrange(1, 300) for _ in range(40)]
    prompts = [[rng.randrange(1, 300) for _ in range(n)] for n in (2, 17, 61, 90)]
    return prompts + [shared + [rng.randrange(1, 300) for _ in range(n)] for n in (5, 13, 21, 30)]


# Which prompts ask for prompt logprobs. Prompt 4 (shared prefix, no logprobs) runs first and
# caches the prefix; 5 and 7 would hit it without the per-sequence opt-out, 6 does hit it.
ASKS = [True, True, True, True, False, True, False, True]


def _hf_prompt_logprobs(folder, prompts) -> list[torch.Tensor]:
    """Per prompt: [len - 1, V] log_softmax of the logits at positions 0 .. len - 2."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0, :-1].float(), dim=-1) for p in prompts]


def assert_matches_hf(prompt_logprobs, prompt: list[int], reference: torch.Tensor, tokenizer=None) -> None:
    """Entry i holds prompt[i] with HF's logprob and rank, and HF's top-N with ranks 1..N."""
    assert prompt_logprobs[0] is None
    assert len(prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry, row, token = prompt_logprobs[i], reference[i - 1], prompt[i]
        value = row[token].item()
        assert entry[token].logprob == pytest.approx(value, abs=1e-4), (i, token)
        # Rank as vLLM counts it: tokens at least as likely, ties included. Exact unless HF holds
        # another token within 1e-4 of this one (then either order is right).
        lowest, highest = int((row > value + 1e-4).sum()) + 1, int((row >= value - 1e-4).sum())
        assert lowest <= entry[token].rank <= highest, (i, token, entry[token].rank, lowest, highest)
        top = torch.topk(row, TOP_N)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[t].logprob == pytest.approx(v, abs=1e-4), (i, t)
            if t != token:  # the prompt token keeps its own rank, checked above
                assert entry[t].rank == rank
        assert set(entry) <= set(top.indices.tolist()) | {token}
        if tokenizer is not None:
            assert entry[token].decoded_token == tokenizer.decode([token])


_reference: dict = {}


def _reference_for(folder):
    if folder not in _reference:
        _reference[folder] = _hf_prompt_logprobs(folder, _prompts())
    return _reference[folder]


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2,
                           prompt_logprobs=TOP_N if asks else None) for asks in ASKS]


def _record_preemptions(llm) -> list[str]:
    """Request ids in the order their sequences were preempted."""
    scheduler, preempted = llm.llm_engine.scheduler, []
    preempt = scheduler._preempt

    def record(seq):
        preempted.append(seq.request_id)
        preempt(seq)

    scheduler._preempt = record
    return preempted


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5"])
def test_prompt_logprobs_match_hf_under_chunking_preemption_and_prefix_caching(
        tiny_checkpoints, tiny_hybrid_checkpoints, arch):
    folder = {**tiny_checkpoints, **tiny_hybrid_checkpoints}[arch]
    prompts, reference = _prompts(), _reference_for(folder)
    llm = LLM(str(folder), dtype="float32", enable_prefix_caching=True, **ENGINE_ARGS)
    preempted = _record_preemptions(llm)
    outputs = llm.generate(prompts, _params())

    asked = {str(i) for i, asks in enumerate(ASKS) if asks}
    assert asked & set(preempted), "no prompt_logprobs request was preempted: the test lost its pressure"
    for i, (output, prompt) in enumerate(zip(outputs, prompts)):
        if ASKS[i]:
            assert_matches_hf(output.prompt_logprobs, prompt, reference[i], llm.get_tokenizer())
            assert output.num_cached_tokens == 0
        else:
            assert output.prompt_logprobs is None
    stats = llm.llm_engine.get_stats()
    assert stats.kv_cache_usage == 0.0
    if arch != "qwen3_5":  # hybrid models run without prefix caching
        assert outputs[6].num_cached_tokens >= 40  # a request without prompt logprobs still hits


def test_prompt_logprobs_do_not_change_the_completion(tiny_checkpoints):
    folder = tiny_checkpoints["llama"]
    llm = LLM(str(folder), dtype="float32", enable_prefix_caching=True, **ENGINE_ARGS)
    with_logprobs = llm.generate(_prompts(), _params())
    plain = llm.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2))
    for a, b in zip(with_logprobs, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4) for t in x)


@pytest.mark.parametrize("arch", ["llama"])
def test_prompt_logprobs_under_tp2_pp2_match_hf(tiny_checkpoints, arch):
    """Logits are gathered to TP rank 0 of the last stage: every TP rank must compute the same
    prompt rows (a collective), and only the sampling rank reports them."""
    folder = tiny_checkpoints[arch]
    llm = LLM(str(folder), dtype="float32", enable_prefix_caching=True, tensor_parallel_size=2,
              pipeline_parallel_size=2,
              **ENGINE_ARGS)
    try:
        outputs = llm.generate(_prompts(), _params())
        assert llm.llm_engine.get_stats().num_preemptions > 0
    finally:
        llm.llm_engine.shutdown()
    for i, (output, prompt) in enumerate(zip(outputs, _prompts())):
        if ASKS[i]:
            assert_matches_hf(output.prompt_logprobs, prompt, _reference_for(folder)[i])


def test_one_token_prompt_chunks_in_graph_replayed_decode_steps_match_hf(tiny_checkpoints, monkeypatch):
    """A budget of 2 tokens: once the first sequence decodes, the second's prompt comes one
    token per step beside it, so those steps are decode-only and replay a decode graph (the
    CPU stand-in for a CUDA capture re-runs the recorded forward over the static buffers)."""
    from tengyun.layers.attention.torch_sdpa import TorchSDPABackend
    from tengyun.platforms.cpu.platform import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "supports_graphs", True)
    monkeypatch.setattr(CpuPlatform, "capture_graph", lambda self, forward, state=(), first=True:
                        (forward(), forward)[1])
    monkeypatch.setattr(CpuPlatform, "graph_batch_limit", lambda self, kernels: 512)  # the stand-in records any size
    monkeypatch.setattr(TorchSDPABackend, "supports_decode_graphs", True)
    folder = tiny_checkpoints["llama"]
    prompts = _prompts()[:2]
    llm = LLM(str(folder), dtype="float32", block_size=8, max_model_len=104, kv_cache_memory="1MiB", max_num_seqs=4,
              max_num_batched_tokens=2)
    graphs = llm.llm_engine.executor.runner.decode_graphs
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=TOP_N)
    outputs = llm.generate(prompts, params)
    assert graphs.steps[2] > 10  # decode + one prompt token, replayed
    for output, prompt, reference in zip(outputs, prompts, _reference_for(folder)):
        assert_matches_hf(output.prompt_logprobs, prompt, reference)
