"""End-to-end engine behaviour on a tiny random Llama: bad input, seeds, stops, n, abort."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tengyun import LLM, SamplingParams

PROMPTS = [[5, 17, 29, 41], [7, 7, 9], list(range(10, 60)), [100, 101, 102, 103, 104, 105]]


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["llama"]), dtype="float32", block_size=8, max_model_len=128,
               kv_cache_memory="2MiB", max_num_batched_tokens=64)


def _assert_idle(llm):
    stats = llm.llm_engine.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


@pytest.mark.parametrize("field, params, prompt", [
    ("max-model-len", dict(), list(range(1, 200))),
    ("max_tokens", dict(max_tokens=0), [1, 2]),
    ("temperature", dict(temperature=-0.5), [1, 2]),
    ("top_p", dict(top_p=0.0), [1, 2]),
    ("top_p", dict(top_p=1.5), [1, 2]),
    ("n", dict(n=0), [1, 2]),
    ("prompt_logprobs", dict(prompt_logprobs=-2), [1, 2]),
    ("prompt_logprobs .* --max-logprobs is 20", dict(prompt_logprobs=-1), [1, 2]),  # the whole vocabulary
    ("logprobs asks for 21 but --max-logprobs is 20", dict(logprobs=21), [1, 2]),
    ("logit_bias .* 384", dict(logit_bias={384: 1.0}), [1, 2]),
    ("logit_bias", dict(logit_bias={"x": 1.0}), [1, 2]),
    ("prompt_token_ids", dict(), [1, 10_000]),
    ("a string or a list of token ids, not a dict", dict(), {"prompt_token_ids": [1, 2]}),
])
def test_bad_input_names_the_field_and_keeps_serving(llm, field, params, prompt):
    engine = llm.llm_engine
    good = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = llm.generate([PROMPTS[0]], good)[0].outputs[0].token_ids
    engine.add_request("good", PROMPTS[0], good)
    engine.step()  # the good request is mid-flight when the bad one arrives
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt, SamplingParams(**params))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert set(outputs) == {"good"}
    assert outputs["good"].outputs[0].token_ids == expected
    _assert_idle(llm)


def test_too_long_prompt_message_has_both_numbers(llm):
    with pytest.raises(ValueError, match=r"199 tokens but --max-model-len is 128"):
        llm.generate([list(range(1, 200))])


def test_seeded_request_ignores_batch_composition(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    noise = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], seeded)[0].outputs[0].token_ids
    crowded = llm.generate(PROMPTS[2:] + [PROMPTS[1]] + PROMPTS[:1], [noise, noise, seeded, noise])
    assert crowded[2].outputs[0].token_ids == alone
    other_seed = llm.generate([PROMPTS[1]], SamplingParams(temperature=1.0, seed=99, max_tokens=12,
                                                           ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_completions_are_indexed_and_seeded_apart(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    first = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == first.outputs[0].token_ids  # completion 0 uses seed 7


def test_stop_string_across_tokens_is_cut_from_text(llm):
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = llm.generate([PROMPTS[3]], params)[0].outputs[0]
    pieces = [tokenizer.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    # A stop string that starts inside token 3 and ends inside token 5 (or later).
    start = len(pieces[3]) - 1 if len(pieces[3]) > len(pieces[2]) else len(pieces[3])
    stop = full.text[start:start + max(3, len(pieces[5]) - start)]
    assert stop and stop in full.text
    out = llm.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    completion = out.outputs[0]
    assert completion.text == full.text[: full.text.index(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    kept = llm.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                     include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_stop_token_ids_end_with_that_reason(llm):
    full = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                    stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_max_tokens_and_max_model_len_end_with_length(llm):
    out = llm.generate([list(range(1, 120))], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 128 - 119
    assert out.outputs[0].finish_reason == "length"


def test_abort_frees_blocks_and_reports_abort(llm):
    engine = llm.llm_engine
    engine.add_request("a", PROMPTS[2], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.get_stats().kv_cache_usage > 0
    engine.abort_request("a")
    outputs = engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outputs] == [("a", "abort")]
    assert not engine.has_unfinished_requests()
    _assert_idle(llm)


def test_engine_package_does_not_import_torch():
    code = (
        "import sys, pkgutil, importlib, tengyun.engine as e\n"
        "for m in pkgutil.iter_modules(e.__path__): importlib.import_module('tengyun.engine.' + m.name)\n"
        "assert 'torch' not in sys.modules, 'engine/ imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty"])
def test_non_finite_sampling_values_are_rejected(field):
    with pytest.raises(ValueError, match=f"{field} must be a finite number"):
        SamplingParams(**{field: float("nan")})


def test_outputs_carry_a_metrics_snapshot_not_the_live_object(llm):
    # The async server reads outputs on another thread while the engine keeps stepping.
    engine = llm.llm_engine
    engine.add_request("snap", PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True))
    first = next(o for o in engine.step() if o.request_id == "snap")
    seen = first.metrics.last_token_time
    while engine.has_unfinished_requests():
        engine.step()
    assert first.metrics.last_token_time == seen
    assert first.metrics.finished_time is None


def test_generate_with_one_bad_prompt_queues_nothing_and_leaks_nothing(llm):
    with pytest.raises(ValueError, match="max-model-len"):
        llm.generate([PROMPTS[0], list(range(1, 200))], SamplingParams(max_tokens=4))
    assert not llm.llm_engine.has_unfinished_requests()
    _assert_idle(llm)
    assert llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids


def test_prompt_logprobs_are_listed_once_per_request_with_n_2(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    one = llm.generate([PROMPTS[2]], params)[0]
    two = llm.generate([PROMPTS[2]], SamplingParams(n=2, temperature=0.0, max_tokens=4, ignore_eos=True,
                                                    prompt_logprobs=3))[0]
    assert len(one.prompt_logprobs) == len(two.prompt_logprobs) == len(PROMPTS[2])
    assert one.prompt_logprobs[0] is None
    for a, b, token in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], PROMPTS[2][1:]):
        assert token in a and len(a) <= 4 and sorted(a) == sorted(b)
        assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-5)
    assert llm.generate([PROMPTS[2]], SamplingParams(max_tokens=2))[0].prompt_logprobs is None
    _assert_idle(llm)


def test_outputs_carry_the_resolved_max_tokens_and_stats_the_kv_block_count(llm):
    # The server's request_params_max_tokens histogram reads metrics.max_tokens.
    asked, unset = llm.generate([PROMPTS[0], PROMPTS[1]], [SamplingParams(max_tokens=5, ignore_eos=True),
                                                          SamplingParams(max_tokens=None)])
    assert asked.metrics.max_tokens == 5
    assert unset.metrics.max_tokens == 128 - len(PROMPTS[1])  # the room left under max_model_len
    engine = llm.llm_engine
    assert engine.get_stats().num_kv_blocks == engine.scheduler.block_manager.num_blocks > 0


def test_max_logprobs_minus_one_gives_the_whole_vocabulary_as_transformers_scores_it(tiny_checkpoints):
    import torch
    from transformers import AutoModelForCausalLM

    folder = tiny_checkpoints["llama"]
    llm = LLM(str(folder), dtype="float32", block_size=8, max_model_len=128, kv_cache_memory="2MiB", max_logprobs=-1)
    prompt = PROMPTS[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=-1,
                                                prompt_logprobs=-1))[0]
    generated = out.outputs[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(torch.tensor([prompt + generated[:1]])).logits[0].log_softmax(-1)  # [P + 1, V]
    vocab = reference.shape[1]  # 384: the model's vocabulary, larger than the tokenizer's 300
    # Row r predicts token r + 1: the prompt's tokens 1.., then the two generated tokens.
    entries = out.prompt_logprobs[1:] + out.outputs[0].logprobs
    assert len(entries) == len(reference) == len(prompt) + 1
    for entry, row in zip(entries, reference):
        assert sorted(entry) == list(range(vocab))
        assert [entry[t].logprob for t in range(vocab)] == pytest.approx(row.tolist(), abs=1e-4)
        assert sorted(lp.rank for lp in entry.values()) == list(range(1, vocab + 1))
