"""stream_interval on a tiny random Llama (vLLM's --stream-interval and SamplingParams.stream_interval):
a running request's outputs go out first, then each time a sequence has N new tokens or finishes,
then last; DELTA outputs still add up to the answer, CUMULATIVE ones are the answer at their step,
and the engine's setting is the floor a request's own value is raised to."""

from __future__ import annotations

import pytest

from tengyun import LLM, SamplingParams
from tengyun.config import EngineConfig
from tengyun.sampling_params import RequestOutputKind

from test_output_kinds import PROMPT, concatenated, run, sequences

CUMULATIVE, DELTA = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA


def make_llm(checkpoint, **kwargs) -> LLM:
    return LLM(str(checkpoint), block_size=8, max_model_len=256, kv_cache_memory="4MiB",
               max_num_batched_tokens=64, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return make_llm(tiny_checkpoints["llama"])


def new_tokens(outputs) -> list[list[int]]:
    """DELTA outputs -> per output, the new token count of each sequence."""
    return [[len(c.token_ids) for c in o.outputs] for o in outputs]


def test_delta_outputs_come_every_n_tokens_and_add_up_to_the_answer(llm):
    greedy = dict(temperature=0.0, max_tokens=23, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    every = run(llm, "every", SamplingParams(**greedy, output_kind=DELTA))
    batched = run(llm, "batched", SamplingParams(**greedy, output_kind=DELTA, stream_interval=5))
    assert new_tokens(every) == [[1]] * 23
    assert new_tokens(batched) == [[1], [5], [5], [5], [5], [2]]  # the first at once, the last whatever is left
    assert concatenated(batched) == concatenated(every)
    assert batched[0].prompt_logprobs == every[0].prompt_logprobs is not None
    assert all(o.prompt_logprobs is None for o in batched[1:])
    assert [o.finished for o in batched] == [False] * 5 + [True]


def test_cumulative_outputs_are_the_answer_at_their_step(llm):
    params = dict(temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=CUMULATIVE)
    every = run(llm, "cum-every", SamplingParams(**params))
    batched = run(llm, "cum-batched", SamplingParams(**params, stream_interval=4))
    assert [len(o.outputs[0].token_ids) for o in batched] == [1, 5, 9, 12]
    assert [sequences(o) for o in batched] == [sequences(every[n - 1]) for n in (1, 5, 9, 12)]


def test_a_sequence_that_finishes_sends_its_tokens_at_once(llm):
    """n = 2 with a stop string that ends completion 0 early: its last tokens and finish reason go
    out in the step it stops, even short of the interval; completion 1 carries on."""
    probe = run(llm, "probe", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=30, ignore_eos=True))
    stop = probe[-1].outputs[0].text[8:11]
    params = dict(n=2, temperature=1.0, seed=3, max_tokens=30, ignore_eos=True, stop=[stop], logprobs=1)
    every = run(llm, "stop-every", SamplingParams(**params, output_kind=CUMULATIVE))
    batched = run(llm, "stop-batched", SamplingParams(**params, output_kind=DELTA, stream_interval=7))
    assert every[-1].outputs[0].stop_reason == stop and every[-1].outputs[1].finish_reason == "length"
    assert concatenated(batched) == sequences(every[-1])
    stopped_at = next(k for k, o in enumerate(every) if o.outputs[0].finish_reason)
    counted = [sum(len(c.token_ids) for c in o.outputs if c.index == 0) for o in batched]
    sent_when = [sum(counted[:k + 1]) for k in range(len(counted))]
    assert len(every[stopped_at].outputs[0].token_ids) in sent_when  # its stop went out when it came
    assert len(batched) < len(every)


def test_the_engines_setting_is_the_floor(tiny_checkpoints):
    llm = make_llm(tiny_checkpoints["llama"], stream_interval=3)
    greedy = dict(temperature=0.0, max_tokens=10, ignore_eos=True, output_kind=DELTA)
    assert new_tokens(run(llm, "default", SamplingParams(**greedy))) == [[1], [3], [3], [3]]
    assert new_tokens(run(llm, "lower", SamplingParams(**greedy, stream_interval=2))) == [[1], [3], [3], [3]]
    assert new_tokens(run(llm, "higher", SamplingParams(**greedy, stream_interval=4))) == [[1], [4], [4], [1]]
    [whole] = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert len(whole.outputs[0].token_ids) == 10


@pytest.mark.parametrize("value", [0, -1, 2.0, True, "3"])
def test_a_bad_stream_interval_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="stream_interval must be an integer >= 1"):
        SamplingParams(stream_interval=value)
    with pytest.raises(ValueError, match="--stream-interval must be an integer >= 1"):
        EngineConfig(stream_interval=value)
