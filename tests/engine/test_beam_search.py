"""LLM.beam_search against HF transformers' generate(num_beams=...) on tiny random models, and
the engine's part: beams fork their parent's KV blocks (copy on write of the partly filled last
block, no prompt recomputed), survive preemption, free everything when aborted."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tengyun import LLM, BeamSearchParams
from tengyun.beam_search import get_beam_search_score

PROMPT = [5, 17, 29, 41, 7, 90, 12, 33, 61, 250, 8]  # 11 tokens: a block and 3 of the next (block size 8)
_llms: dict[str, LLM] = {}


def tiny_llm(checkpoints, arch: str) -> LLM:
    if arch not in _llms:
        _llms[arch] = LLM(str(checkpoints[arch]), dtype="float32", block_size=8, max_model_len=128,
                          kv_cache_memory="2MiB")
    return _llms[arch]


def hf_model(checkpoints, arch: str):
    return AutoModelForCausalLM.from_pretrained(checkpoints[arch], dtype=torch.float32).eval()


def hf_beams(model, prompt: list[int], width: int, max_tokens: int, length_penalty: float):
    """HF's beams and their cumulative logprobs (its score times generated length ** length_penalty),
    EOS switched off so every beam runs max_tokens (HF and vLLM then rank alike, see beam_search.py)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                             do_sample=False, max_new_tokens=max_tokens, length_penalty=length_penalty,
                             early_stopping="never", eos_token_id=None, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    return [(seq[len(prompt):].tolist(), score.item() * max_tokens ** length_penalty)
            for seq, score in zip(out.sequences, out.sequences_scores)]


@pytest.mark.parametrize("arch, length_penalty", [("qwen2", 1.0), ("qwen3", 0.0), ("llama", 2.0)])
def test_beams_match_hf_generate_num_beams(tiny_checkpoints, arch, length_penalty):
    width, max_tokens = 3, 10
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True, length_penalty=length_penalty)
    ours = tiny_llm(tiny_checkpoints, arch).beam_search([{"prompt_token_ids": PROMPT}], params)[0].sequences
    reference = hf_beams(hf_model(tiny_checkpoints, arch), PROMPT, width, max_tokens, length_penalty)
    assert [s.tokens[len(PROMPT):] for s in ours] == [tokens for tokens, _ in reference]
    assert [s.cum_logprob for s in ours] == pytest.approx([cum for _, cum in reference], abs=2e-3)
    assert all(s.tokens[:len(PROMPT)] == PROMPT and s.finish_reason == "length" for s in ours)


def teacher_forced_logprob(model, prompt: list[int], tokens: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return sum(logprobs[i, t].item() for i, t in enumerate(tokens))


def test_eos_ended_beams_are_kept_and_ranked_as_vllm(tiny_checkpoints):
    """The tiny qwen2 puts its EOS (id 0) among the candidates: those beams finish with it, keep it in
    tokens (LLM.beam_search, as vLLM's), and rank by cum / (len without the EOS) ** length_penalty."""
    llm = tiny_llm(tiny_checkpoints, "qwen2")
    prompt = PROMPT[:5]
    params = BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=0.5)
    beams = llm.beam_search([prompt], params)[0].sequences
    assert len(beams) == 3 and {b.finish_reason for b in beams} == {"stop", "length"}
    model = hf_model(tiny_checkpoints, "qwen2")
    for beam in beams:
        outputs = beam.tokens[len(prompt):]
        assert (outputs[-1] == 0) == (beam.finish_reason == "stop") and 0 not in outputs[:-1]
        assert beam.cum_logprob == pytest.approx(teacher_forced_logprob(model, prompt, outputs), abs=2e-3)
        assert beam.text == llm.get_tokenizer().decode(beam.tokens)
        assert len(beam.logprobs) == len(outputs) and all(len(step) >= 6 for step in beam.logprobs)
    scores = [get_beam_search_score(b.tokens, b.cum_logprob, 0, 0.5) for b in beams]
    assert scores == sorted(scores, reverse=True)


def test_early_stopping_true_ends_with_the_first_finished_beams(tiny_checkpoints):
    llm = tiny_llm(tiny_checkpoints, "qwen2")
    full = llm.beam_search([PROMPT[:5]], BeamSearchParams(beam_width=2, max_tokens=40, length_penalty=0.0))
    early = llm.beam_search([PROMPT[:5]], BeamSearchParams(beam_width=2, max_tokens=40, length_penalty=0.0,
                                                           early_stopping=True))
    assert [b.finish_reason for b in early[0].sequences] == ["stop", "stop"]
    # "never" (the default) searched on, and can only have found beams at least as good
    assert full[0].sequences[0].cum_logprob >= early[0].sequences[0].cum_logprob


class StepRecorder:
    """Wraps the real executor: keeps every SchedulerOutput it runs."""

    def __init__(self, engine):
        self.engine, self.real, self.steps = engine, engine.executor.execute_model, []

    def __enter__(self):
        self.engine.executor.execute_model = lambda sched: (self.steps.append(sched), self.real(sched))[1]
        return self

    def __exit__(self, *exc):
        self.engine.executor.execute_model = self.real


def test_beams_share_the_prompt_kv_and_copy_only_the_partial_block(tiny_checkpoints):
    llm = tiny_llm(tiny_checkpoints, "llama")
    engine = llm.llm_engine
    width, max_tokens, prompt = 4, 7, PROMPT[::-1]  # a prompt no earlier test cached
    with StepRecorder(engine) as recorder:
        llm.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
    first, rest = recorder.steps[0], recorder.steps[1:]
    assert first.num_scheduled_tokens == {first.new_seqs[0].seq_id: len(prompt)}  # the prompt, once
    assert len(rest) == max_tokens - 1  # then one token per live beam per round, nothing recomputed
    for step in rest:
        assert list(step.num_scheduled_tokens.values()) == [1] * width
        assert all(new.num_computed_tokens == len(new.token_ids) - 1 for new in step.new_seqs)
    # Round 1 forks 4 beams off the prompt's partly filled block 1 (tokens 8..10): 3 copies of it, the
    # 4th beam writes in place. Later rounds copy once per extra child of a parent, while the new
    # token lands in a partly filled block: position 16 starts block 2, so its round copies nothing.
    assert [src for src, _ in rest[0].block_copies] == [first.new_seqs[0].block_table[1]] * (width - 1)
    for step in rest[1:5]:
        parents = {tuple(new.token_ids[:-1]) for new in step.new_seqs}
        assert len(step.block_copies) == width - len(parents)
    assert rest[5].block_copies == [] and len(rest[5].new_seqs[0].token_ids) == 17
    stats = engine.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


def test_search_survives_preemption_with_the_same_beams(tiny_checkpoints):
    params = BeamSearchParams(beam_width=4, max_tokens=24, ignore_eos=True)
    roomy = tiny_llm(tiny_checkpoints, "llama").beam_search([PROMPT], params)[0].sequences
    # 6 blocks of 8 tokens (512 B a token): four 35-token beams need up to 20 less what they share.
    # Parked beams (reported, waiting for their round's siblings) give up their blocks too, or no
    # preempted sibling could come back.
    tight = LLM(str(tiny_checkpoints["llama"]), dtype="float32", block_size=8, max_model_len=40,
                kv_cache_memory=f"{6 * 8 * 512}B", max_num_seqs=4)
    beams = tight.beam_search([PROMPT], params)[0].sequences
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert [b.tokens for b in beams] == [b.tokens for b in roomy]
    assert [b.cum_logprob for b in beams] == pytest.approx([b.cum_logprob for b in roomy], abs=1e-4)
    assert tight.llm_engine.get_stats().kv_cache_usage == 0.0


def test_text_and_token_prompts_and_concurrency_limit_give_the_same_beams(tiny_checkpoints):
    llm = tiny_llm(tiny_checkpoints, "qwen3")
    text = "The quick brown fox"
    ids = llm.get_tokenizer().encode(text)
    params = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)
    together = llm.beam_search([{"prompt": text}, {"prompt_token_ids": ids}, text, PROMPT], params)
    one_at_a_time = llm.beam_search([text, PROMPT], params, concurrency_limit=1)
    assert [b.tokens for b in together[0].sequences] == [b.tokens for b in together[1].sequences] \
        == [b.tokens for b in together[2].sequences] == [b.tokens for b in one_at_a_time[0].sequences]
    assert [b.tokens for b in together[3].sequences] == [b.tokens for b in one_at_a_time[1].sequences]


def test_abort_mid_search_frees_every_block(tiny_checkpoints):
    engine = tiny_llm(tiny_checkpoints, "llama").llm_engine
    engine.add_request("beams", PROMPT, BeamSearchParams(beam_width=3, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort_request("beams")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [(o.request_id, o.finished, o.outputs) for o in outputs] == [("beams", True, [])]
    assert all(block.ref_count == 0 for block in engine.scheduler.block_manager.blocks)


@pytest.mark.parametrize("params, message", [
    (dict(beam_width=0, max_tokens=4), "beam_width must be an integer >= 1"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(beam_width=2, max_tokens=4, early_stopping="sometimes"), "early_stopping must be"),
])
def test_bad_params_name_the_field(params, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**params)


def test_beam_width_over_the_engine_limits_is_refused_and_nothing_queued(tiny_checkpoints):
    engine = tiny_llm(tiny_checkpoints, "llama").llm_engine
    with pytest.raises(ValueError, match=r"beam_width 11 ranks 22 .* --max-logprobs is 20: .* at most 10"):
        engine.add_request("wide", PROMPT, BeamSearchParams(beam_width=11, max_tokens=4))
    assert not engine.has_unfinished_requests()


def test_hybrid_models_refuse_beam_search(tiny_hybrid_checkpoints):
    llm = LLM(str(tiny_hybrid_checkpoints["qwen3_5"]), dtype="float32", max_model_len=64, kv_cache_memory="1MiB")
    with pytest.raises(ValueError, match="not supported on hybrid models"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=4))
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_two_ranks_find_the_beams_one_does(tiny_checkpoints, parallel):
    """Every rank copies its own layers' blocks (TP: its heads, PP: its stage, with two batches in flight)."""
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    one = tiny_llm(tiny_checkpoints, "llama").beam_search([PROMPT[::-1]], params)[0].sequences
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", block_size=8, max_model_len=128,
              kv_cache_memory="2MiB", **parallel)
    try:
        two = llm.beam_search([PROMPT[::-1]], params)[0].sequences
    finally:
        llm.llm_engine.shutdown()
    assert [b.tokens for b in two] == [b.tokens for b in one]
    assert [b.cum_logprob for b in two] == pytest.approx([b.cum_logprob for b in one], abs=1e-4)


def vllm_front_end_loop(llm: LLM, prompt: list[int], width: int, max_tokens: int, length_penalty: float,
                        eos: int) -> list[tuple[list[int], float]]:
    """vLLM 0.11's LLM.beam_search loop, transcribed: each round every live beam is a 1-token request
    (logprobs 2 x width); EOS candidates finish, the width best others go on; after max_tokens
    rounds finished and live beams are ranked together. -> [(tokens, cum logprob)], best first."""
    key = lambda beam: get_beam_search_score(beam[0], beam[1], eos, length_penalty)  # noqa: E731
    from tengyun import SamplingParams

    step = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * width, ignore_eos=True)
    live, finished = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        outputs = llm.generate([{"prompt_token_ids": tokens} for tokens, _ in live], step)
        candidates = []
        for (tokens, cum), out in zip(live, outputs):
            for token, logprob in out.outputs[0].logprobs[0].items():
                (finished if token == eos else candidates).append((tokens + [token], cum + logprob.logprob))
        live = sorted(candidates, key=key, reverse=True)[:width]
    return sorted(finished + live, key=key, reverse=True)[:width]


@pytest.mark.parametrize("length_penalty", [0.5, 0.0, -1.0])
def test_same_beams_as_vllms_front_end_loop_with_eos_on(tiny_checkpoints, length_penalty):
    """EOS candidates of any rank finish, and the search that ends early (no live beam can still win)
    gives the answer of all max_tokens rounds."""
    llm = tiny_llm(tiny_checkpoints, "qwen2")
    engine = llm.llm_engine
    prompt, width, max_tokens = PROMPT[:5], 2, 40
    request = engine.add_request(f"eos-{length_penalty}", prompt, BeamSearchParams(
        beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty, include_stop_str_in_output=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert request.num_steps < max_tokens  # ended early
    ours = outputs[-1].outputs
    reference = vllm_front_end_loop(llm, prompt, width, max_tokens, length_penalty, eos=0)
    assert [prompt + c.token_ids for c in ours] == [tokens for tokens, _ in reference]
    assert [c.cumulative_logprob for c in ours] == pytest.approx([cum for _, cum in reference], abs=1e-4)
    assert [c.finish_reason for c in ours] == ["stop"] * width and [c.index for c in ours] == [0, 1]
