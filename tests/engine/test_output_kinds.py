"""RequestOutputKind on a tiny random Llama: DELTA outputs carry each token once (a long answer
costs O(length), not O(length^2)), DELTA and FINAL_ONLY add up to the CUMULATIVE answer (text
with stop strings held back, logprobs, n = 2, prompt logprobs once), and progress records
report every step whatever the kind."""

from __future__ import annotations

import pytest

from tengyun import LLM, SamplingParams
from tengyun.sampling_params import RequestOutputKind

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
PROMPT = [100, 101, 102, 103, 104, 105]


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["llama"]), block_size=8, max_model_len=256, kv_cache_memory="4MiB",
               max_num_batched_tokens=64)


def run(llm, request_id: str, params: SamplingParams, abort_after: int | None = None) -> list:
    """Every RequestOutput of one request, alone in the engine; aborted after `abort_after` steps."""
    engine = llm.llm_engine
    engine.add_request(request_id, PROMPT, params)
    outputs, steps = [], 0
    while engine.has_unfinished_requests():
        if steps == abort_after:
            engine.abort_request(request_id)
        outputs += engine.step()
        steps += 1
    assert all(o.request_id == request_id for o in outputs)
    return outputs


def sequences(output) -> list[tuple]:
    return [(c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason)
            for c in output.outputs]


def concatenated(deltas: list) -> list[tuple]:
    """The CUMULATIVE view of DELTA outputs: text, token ids and logprobs joined per sequence;
    cumulative logprob, finish and stop reason as the last output says."""
    seqs: list[list] = []
    for output in deltas:
        for c in output.outputs:
            if c.index == len(seqs):
                seqs.append(["", [], [] if c.logprobs is not None else None])
            seq = seqs[c.index]
            seq[0] += c.text
            seq[1] += c.token_ids
            if c.logprobs is not None:
                seq[2] += c.logprobs
            seq[3:] = [c.cumulative_logprob, c.finish_reason, c.stop_reason]
    return [tuple(seq) for seq in seqs]


def test_delta_outputs_carry_each_token_once_however_long_the_answer(llm):
    length = 200
    kinds = {}
    for kind in (CUMULATIVE, DELTA, FINAL_ONLY):
        params = SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True, logprobs=2, output_kind=kind)
        kinds[kind] = run(llm, f"long-{kind.name}", params)
    carried = {kind: sum(len(c.token_ids) for o in outputs for c in o.outputs) for kind, outputs in kinds.items()}
    # CUMULATIVE: 1 + 2 + ... + 200 ids over 200 outputs; DELTA: each id once; FINAL_ONLY: one output.
    assert carried == {CUMULATIVE: length * (length + 1) // 2, DELTA: length, FINAL_ONLY: length}
    assert [len(o.outputs[0].token_ids) for o in kinds[DELTA]] == [1] * length
    assert sum(len(o.outputs[0].logprobs) for o in kinds[DELTA]) == length
    assert sum(len(o.outputs[0].text) for o in kinds[DELTA]) == len(kinds[CUMULATIVE][-1].outputs[0].text)
    assert len(kinds[FINAL_ONLY]) == 1 and kinds[FINAL_ONLY][0].finished


def stop_in_the_middle(llm) -> str:
    """3 characters from the middle of completion 0's answer: a stop string held back 2 chars."""
    text = run(llm, "probe", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=20,
                                            ignore_eos=True))[-1].outputs[0].text
    assert len(text) > 12, text
    return text[8:11]


@pytest.mark.parametrize("include_stop", [False, True])
def test_delta_and_final_only_add_up_to_the_cumulative_answer(llm, include_stop):
    stop = stop_in_the_middle(llm)
    runs = {}
    for kind in (CUMULATIVE, DELTA, FINAL_ONLY):
        params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True, logprobs=3,
                                prompt_logprobs=2, stop=[stop], include_stop_str_in_output=include_stop,
                                output_kind=kind)
        runs[kind] = run(llm, f"same-{kind.name}-{include_stop}", params)
    cumulative, deltas = runs[CUMULATIVE], runs[DELTA]
    final = cumulative[-1]
    assert final.outputs[0].stop_reason == stop  # the stop string did end completion 0
    assert len(deltas) == len(cumulative)  # one output per step, as CUMULATIVE
    for step in range(len(cumulative)):  # after every step, the deltas so far are the answer so far
        assert concatenated(deltas[: step + 1]) == sequences(cumulative[step])
    assert deltas[0].prompt_logprobs == final.prompt_logprobs and len(final.prompt_logprobs) == len(PROMPT)
    assert all(o.prompt_logprobs is None for o in deltas[1:])  # sent once
    assert [o.finished for o in deltas] == [o.finished for o in cumulative]
    [only] = runs[FINAL_ONLY]
    assert only.finished and sequences(only) == sequences(final) and only.prompt_logprobs == final.prompt_logprobs


def test_an_aborted_delta_request_sends_the_text_it_held_back(llm):
    kinds = {}
    for kind in (CUMULATIVE, DELTA):
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, stop=["never seen"],
                                output_kind=kind)
        kinds[kind] = run(llm, f"abort-{kind.name}", params, abort_after=6)
    final = kinds[CUMULATIVE][-1]
    assert final.outputs[0].finish_reason == "abort" and len(final.outputs[0].token_ids) == 6
    assert len(kinds[CUMULATIVE][-2].outputs[0].text) < len(final.outputs[0].text)  # up to 9 chars were held back
    assert concatenated(kinds[DELTA]) == sequences(final)


def test_progress_reports_every_step_of_a_final_only_request(llm):
    engine = llm.llm_engine
    engine.add_request("final", PROMPT, SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=4,
                                                       ignore_eos=True, output_kind=FINAL_ONLY))
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step_with_progress())
    assert [len(outputs) for outputs, _ in steps] == [0, 0, 0, 1]
    progress = [record for _, records in steps for record in records]
    assert [(p.request_id, p.num_output_tokens, p.finished) for p in progress] == [
        ("final", [1, 1], False), ("final", [2, 2], False), ("final", [3, 3], False), ("final", [4, 4], True)]
    assert progress[-1].finish_reasons == ["length", "length"] and progress[-1].num_prompt_tokens == len(PROMPT)
    assert progress[0].metrics.first_token_time is not None and progress[-1].metrics.finished_time is not None


def test_llm_generate_builds_only_final_outputs_and_leaves_the_callers_params_alone(llm, monkeypatch):
    engine = llm.llm_engine
    built, step = [], engine.step

    def counting_step():
        outputs = step()
        built.extend(outputs)
        return outputs

    monkeypatch.setattr(engine, "step", counting_step)
    params = SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True, logprobs=1)
    [output] = llm.generate([PROMPT], params)
    assert params.output_kind is CUMULATIVE
    assert built == [output]  # one output in 12 steps
    monkeypatch.undo()
    assert sequences(output) == sequences(run(llm, "cumulative", params)[-1])


def test_output_kind_must_be_a_request_output_kind():
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")
