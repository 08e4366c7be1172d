"""Structured output: grammars compile (or fail naming the problem), the worker's matchers mask
the constrained rows of a mixed batch, and a preempted request resumes its grammar."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tengyun import LLM, SamplingParams
from tengyun.sampling_params import StructuredOutputsParams
from tengyun.structured_output import GrammarCompiler, choice_ebnf
from tengyun.worker.grammar_state import GrammarState

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["a", "b"]}},
          "required": ["ok", "tag"]}
CHOICES = ["Paris", 'say "hi"', "a\\b"]
REGEX = r"[0-9]{3}-[a-c]{2}"


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, 384, [0])  # the model's 384 rows > the tokenizer's 300 ids


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["llama"]), block_size=8, max_model_len=256, kv_cache_memory="4MiB",
               max_num_batched_tokens=64)


def _spec(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(json={"type": "foo"}), r'structured_outputs.json\) does not compile: Unsupported type "foo"'),
    (dict(json="{not json"), r"structured_outputs.json\) does not compile"),
    (dict(regex="[a-"), r"structured_outputs.regex\) does not compile: .*Unclosed '\['"),
    (dict(grammar="root ::= missing_rule"), r"structured_outputs.grammar\) does not compile"),
])
def test_bad_constraint_is_a_value_error_naming_field_and_reason(compiler, kwargs, message):
    with pytest.raises(ValueError, match=message):
        compiler.compile(_spec(**kwargs))


@pytest.mark.parametrize("kwargs", [dict(), dict(json=SCHEMA, regex="a"), dict(choice=[]), dict(choice=["a", ""])])
def test_params_need_exactly_one_valid_constraint(kwargs):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**kwargs)


def test_choice_grammar_accepts_exactly_the_choices_with_quotes_and_backslashes(compiler):
    import xgrammar

    assert choice_ebnf(["a", 'say "hi"']) == 'root ::= "a" | "say \\"hi\\""'
    grammar = compiler.compile(_spec(choice=CHOICES))
    for text in CHOICES:
        matcher = xgrammar.GrammarMatcher(grammar)
        assert matcher.accept_string(text) and matcher.is_completed()
    matcher = xgrammar.GrammarMatcher(grammar)
    assert not matcher.accept_string("Berlin")


def test_bitmask_only_for_constrained_unfinished_rows_and_replays_after_restart(compiler, tokenizer):
    state = GrammarState(lambda: compiler, 384)
    state.add(1, SamplingParams(structured_outputs=_spec(choice=["yes", "no"])), [])
    state.add(2, SamplingParams(), [])  # free
    assert state.bitmask([2]) is None
    rows, mask = state.bitmask([2, 1])
    assert rows == [1] and mask.shape == (1, 12) and mask.dtype == torch.int32

    ids = tokenizer.encode("yes", add_special_tokens=False)
    for token in ids:
        state.accept(1, token)
    after = state.bitmask([1])[1]
    state.add(1, SamplingParams(structured_outputs=_spec(choice=["yes", "no"])), ids)  # preempted: replay
    assert torch.equal(state.bitmask([1])[1], after)
    assert _allowed(after[0]) == [0]  # "yes" is complete: only EOS (id 0) remains
    state.accept(1, 0)
    assert state.bitmask([1]) is None  # terminated: unconstrained (ignore_eos goes on freely)


def _allowed(words: torch.Tensor) -> list[int]:
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten().nonzero().flatten().tolist()


def _check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "choice":
        assert text in CHOICES
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)


CONSTRAINTS = {"json": dict(json=SCHEMA), "choice": dict(choice=CHOICES), "regex": dict(regex=REGEX)}


def test_random_model_obeys_constraints_in_a_batch_with_free_rows(llm):
    # Random weights: without the masks, none of these would parse.
    kinds = ["json", "choice", "regex", "free", "json", "choice", "regex", "free"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40,
                             structured_outputs=_spec(**CONSTRAINTS[k]) if k != "free" else None)
              for i, k in enumerate(kinds)]
    outputs = llm.generate([[5, 17, 29, 41]] * len(kinds), params)
    for kind, out, p in zip(kinds, outputs, params):
        completion = out.outputs[0]
        if kind == "free":
            alone = llm.generate([[5, 17, 29, 41]], p)[0].outputs[0]
            assert completion.token_ids == alone.token_ids  # masks never touch free rows
        else:
            assert completion.finish_reason == "stop"
            _check(kind, completion.text)


def test_json_object_gives_an_object_even_greedy(llm):
    out = llm.generate([[7, 7, 9]], SamplingParams(temperature=0.0, max_tokens=60,
                                                   structured_outputs=_spec(json_object=True)))[0].outputs[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # a random model may keep the object open until max_tokens: still a valid prefix
        assert out.text.startswith("{")


def test_preempted_constrained_requests_resume_their_grammar(tiny_checkpoints):
    small = LLM(str(tiny_checkpoints["llama"]), block_size=8, max_model_len=112, num_gpu_blocks_override=14,
                max_num_batched_tokens=64)
    kinds = ["json", "choice", "regex"] * 3
    prompts = [list(range(10 + i, 40 + i)) for i in range(len(kinds))]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=_spec(**CONSTRAINTS[k]))
              for i, k in enumerate(kinds)]
    outputs = small.generate(prompts, params)
    assert small.llm_engine.get_stats().num_preemptions > 0
    for kind, out, p, prompt in zip(kinds, outputs, params, prompts):
        _check(kind, out.outputs[0].text)
        alone = small.generate([prompt], p)[0].outputs[0]
        assert out.outputs[0].token_ids == alone.token_ids


def test_invalid_schema_is_rejected_before_queueing(llm):
    with pytest.raises(ValueError, match="structured_outputs.json"):
        llm.llm_engine.add_request("bad", [1, 2], SamplingParams(structured_outputs=_spec(json={"type": "foo"})))
    assert not llm.llm_engine.has_unfinished_requests()


def test_required_tool_choice_schema_makes_a_random_model_call_validly(llm):
    from tengyun.entrypoints.openai.chat_output import ChoiceOutputParser
    from tengyun.entrypoints.openai.tool_parsers.required_calls import RequiredCallsParser, required_calls_schema

    parameters = {"type": "object", "required": ["unit", "days"],
                  "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "required": ["tz"], "additionalProperties": False,
                 "properties": {"tz": {"enum": ["utc", "cet"]}}}}}]
    schema = required_calls_schema([t["function"] for t in tools], parallel_tool_calls=False)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs=_spec(json=schema))
              for i in range(4)]
    for out in llm.generate([[5, 17, 29, 41]] * 4, params):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        [call] = ChoiceOutputParser(tool_parser=RequiredCallsParser(tools)).parse(completion.text).tool_calls
        jsonschema.validate(json.loads(call.arguments), {t["function"]["name"]: t["function"]["parameters"]
                                                          for t in tools}[call.name])


@pytest.mark.parametrize("kwargs, answer", [
    (dict(json=SCHEMA), '{"ok": true, "tag": "b"}'),
    (dict(choice=CHOICES), 'say "hi"'),
    (dict(regex=REGEX), "123-ab"),
])
def test_after_reasoning_constrains_only_what_follows_the_thoughts(compiler, kwargs, answer):
    import xgrammar

    from tengyun.structured_output import after_reasoning

    grammar = compiler.compile(after_reasoning(_spec(**kwargs)))
    matcher = xgrammar.GrammarMatcher(grammar)
    assert matcher.accept_string('Free thoughts: {"x": <b>} 123.\n</think>\n\n' + answer) and matcher.is_completed()
    matcher = xgrammar.GrammarMatcher(grammar)
    assert not matcher.accept_string("Thoughts.</think>\n\nnot the constraint")


def test_after_reasoning_keeps_the_error_of_a_bad_constraint():
    from tengyun.structured_output import after_reasoning

    with pytest.raises(ValueError, match=r'structured_outputs.json\) does not compile: Unsupported type "foo"'):
        after_reasoning(_spec(json={"type": "foo"}))
