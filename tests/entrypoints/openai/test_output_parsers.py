"""Tool-call (hermes, qwen3_coder) and reasoning (qwen3) parsers on recorded Qwen outputs: whole, and
streamed in every possible two-chunk split and one character at a time, the deltas adding up to
exactly the whole-text result."""

from __future__ import annotations

import json
import logging

import pytest

from tengyun.entrypoints.openai.chat_output import ChoiceOutputParser
from tengyun.entrypoints.openai.reasoning_parsers import Qwen3ReasoningParser, get_reasoning_parser
from tengyun.entrypoints.openai.tool_parsers import HermesToolParser, get_tool_parser
from tengyun.entrypoints.openai.tool_parsers.required_calls import RequiredCallsParser, required_calls_schema

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "unit": {"type": "string", "enum": ["c", "f"]}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                         "overwrite": {"type": "boolean"}, "tags": {"type": "array"},
                                         "ratio": {"type": "number"}}}}},
]

# (name, parser, in_reasoning, text, expected reasoning, expected content, expected [(name, arguments)])
CASES = [
    ("hermes_two_calls", "hermes", False,
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco", "unit": "c"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "北京", "days": 3}}\n</tool_call>',
     None, "", [("get_weather", {"city": "San Francisco", "unit": "c"}),
                ("get_weather", {"city": "北京", "days": 3})]),
    ("hermes_text_then_call", "hermes", False,
     'Let me look that up for you.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     '</tool_call>', None, "Let me look that up for you.", [("get_weather", {"city": "Paris"})]),
    ("hermes_plain_answer", "hermes", False, "The capital of France is Paris. Use <b>tags</b> < 3.",
     None, "The capital of France is Paris. Use <b>tags</b> < 3.", []),
    ("hermes_malformed_json_is_content", "hermes", False,
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
     None, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>', []),
    ("hermes_unclosed_at_end", "hermes", False,
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n',
     None, "", [("get_weather", {"city": "Oslo"})]),
    ("hermes_cut_off_inside_a_call", "hermes", False,
     'Let me check.\n<tool_call>\n{"name": "get_weather", "argu', None, "Let me check.", []),
    ("hermes_cut_off_in_the_start_tag", "hermes", False, "Let me check.\n<tool_c", None, "Let me check.", []),
    ("hermes_cut_off_after_a_call", "hermes", False,
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"na',
     None, "", [("get_weather", {"city": "Oslo"})]),
    ("hermes_string_arguments", "hermes", False,
     '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>',
     None, "", [("get_weather", {"city": "Rome"})]),
    ("qwen3_think_then_call", "hermes", False,
     "<think>\nThe user wants the weather in 北京. I should call get_weather.\n</think>\n\n"
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "北京"}}\n</tool_call>',
     "The user wants the weather in 北京. I should call get_weather.", "", [("get_weather", {"city": "北京"})]),
    ("qwen3_think_then_answer", None, False,
     "<think>\nOkay, 2 + 2.\n\nThat is 4.\n</think>\n\n2 + 2 = **4**.",
     "Okay, 2 + 2.\n\nThat is 4.", "2 + 2 = **4**.", []),
    ("qwen3_2507_prompt_opened_think", None, True,
     "The user asks 2+2. That's 4.\n</think>\n\n2 + 2 = 4.", "The user asks 2+2. That's 4.", "2 + 2 = 4.", []),
    ("qwen3_thinking_disabled", None, False, "你好！有什么可以帮你的吗？😀", None, "你好！有什么可以帮你的吗？😀", []),
    ("qwen3_truncated_in_thought", None, False, "<think>\nLet me think about </thi", "Let me think about </thi", "",
     []),
    ("qwen3_coder_text_then_call", "qwen3_coder", False,
     "I'll write the file.\n<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/main.py\n</parameter>\n"
     "<parameter=content>\ndef f(a, b):\n    return a < b\n\n</parameter>\n<parameter=overwrite>\ntrue\n"
     "</parameter>\n<parameter=tags>\n[\"py\", \"new\"]\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
     "</function>\n</tool_call>",
     None, "I'll write the file.",
     [("write_file", {"path": "src/main.py", "content": "def f(a, b):\n    return a < b\n", "overwrite": True,
                      "tags": ["py", "new"], "ratio": 0.5})]),
    ("qwen3_coder_two_calls_missing_close_parameter", "qwen3_coder", False,
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=get_weather>\n<parameter=city>\n東京\n</parameter>\n</function>\n</tool_call>",
     None, "", [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "東京"})]),
    ("qwen3_coder_cut_off_inside_a_call", "qwen3_coder", False,
     "Writing it.\n<tool_call>\n<function=write_file>\n<parameter=pa", None, "Writing it.", []),
    ("qwen3_coder_no_function_is_content", "qwen3_coder", False, "<tool_call>\nget_weather(Paris)\n</tool_call>",
     None, "<tool_call>\nget_weather(Paris)\n</tool_call>", []),
    ("qwen3_think_then_coder_call", "qwen3_coder", True,
     "Need weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=days>\n7\n</parameter>\n"
     "</function>\n</tool_call>", "Need weather.", "", [("get_weather", {"days": 7})]),
    # Recorded: the embedded Qwen2.5-Coder-0.5B-Instruct, greedy, with tools in its template, writes
    # markdown JSON instead of <tool_call>: no call to take, the text stays content.
    ("qwen2.5_coder_0.5b_recorded_markdown_json", "hermes", False,
     '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Beijing",\n    "unit": "celsius"\n'
     '  }\n}\n```', None,
     '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Beijing",\n    "unit": "celsius"\n'
     '  }\n}\n```', []),
]
REASONING = {"qwen3_think_then_call", "qwen3_think_then_answer", "qwen3_2507_prompt_opened_think",
             "qwen3_thinking_disabled", "qwen3_truncated_in_thought", "qwen3_think_then_coder_call"}


def _parser(name: str, tool: str | None, in_reasoning: bool) -> ChoiceOutputParser:
    return ChoiceOutputParser(Qwen3ReasoningParser() if name in REASONING else None,
                              get_tool_parser(tool)(TOOLS) if tool else None, in_reasoning)


def _calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def _stream(parser: ChoiceOutputParser, chunks: list[str]):
    """Feed growing text as the server does; return (reasoning, content, calls) summed from deltas."""
    text, reasoning, content, calls = "", "", "", []
    for k, chunk in enumerate(chunks):
        text += chunk
        delta = parser.delta(text, finished=k == len(chunks) - 1)
        reasoning += delta.reasoning or ""
        content += delta.content
        calls += delta.tool_calls
    return reasoning, content, calls


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_whole_output(case):
    name, tool, in_reasoning, text, reasoning, content, calls = case
    parsed = _parser(name, tool, in_reasoning).parse(text)
    assert (parsed.reasoning, parsed.content, _calls(parsed)) == (reasoning, content, calls)
    for call in parsed.tool_calls:
        assert call.id.startswith("call_") and isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_streamed_at_every_split_equals_whole(case):
    name, tool, in_reasoning, text, reasoning, content, calls = case
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for chunks in splits:
        got_reasoning, got_content, got_calls = _stream(_parser(name, tool, in_reasoning), chunks)
        assert got_reasoning == (reasoning or ""), chunks
        assert got_content == content, chunks
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls, chunks


def test_streamed_markup_never_leaks_into_content():
    text = CASES[1][3]
    parser = _parser("hermes_text_then_call", "hermes", False)
    seen = ""
    for i in range(1, len(text) + 1):
        seen += parser.delta(text[:i], finished=i == len(text)).content
        assert "<" not in seen, seen


def test_missing_think_start_without_prompt_hint_is_reasoning_only_when_whole():
    text = "Plan it.\n</think>\n\nDone."
    assert ChoiceOutputParser(Qwen3ReasoningParser()).parse(text).reasoning == "Plan it."
    # Streaming cannot take back text already sent as content: the prompt hint is what it relies on.
    assert _stream(ChoiceOutputParser(Qwen3ReasoningParser()), list(text))[1] == text


def test_malformed_call_logs_a_warning_once(caplog):
    text = CASES[3][3]
    parser = _parser("x", "hermes", False)
    with caplog.at_level(logging.WARNING, logger="tengyun.tool_parser"):
        _stream(parser, list(text))
    assert sum("does not parse" in r.message for r in caplog.records) == 1


def test_prompt_ending_in_think_opens_reasoning():
    parser = Qwen3ReasoningParser()
    assert parser.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not parser.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_unknown_parser_names_the_flag():
    with pytest.raises(ValueError, match="--tool-call-parser 'nope'"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="--reasoning-parser 'nope'"):
        get_reasoning_parser("nope")


def _required_matcher(tiny_tokenizer_dir, parallel_tool_calls: bool):
    import xgrammar
    from transformers import AutoTokenizer

    schema = required_calls_schema([t["function"] for t in TOOLS], parallel_tool_calls)
    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tiny_tokenizer_dir), vocab_size=384)
    compiled = xgrammar.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(schema))
    return xgrammar.GrammarMatcher(compiled)


REQUIRED_TWO = ('[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}, '
                '{"name": "write_file", "parameters": {"path": "a.txt"}}]')


def test_required_calls_are_vllms_json_array_of_name_and_parameters(tiny_tokenizer_dir):
    assert _required_matcher(tiny_tokenizer_dir, True).accept_string(REQUIRED_TWO)
    parsed = ChoiceOutputParser(tool_parser=RequiredCallsParser(TOOLS)).parse(REQUIRED_TWO)
    assert (parsed.content, _calls(parsed)) == ("", [("get_weather", {"city": "Paris", "days": 3}),
                                                     ("write_file", {"path": "a.txt"})])
    matcher = _required_matcher(tiny_tokenizer_dir, True)  # a name that is not a tool
    assert not matcher.accept_string('[{"name": "rm_rf", "parameters": {}}]')


def test_required_without_parallel_tool_calls_allows_exactly_one_call(tiny_tokenizer_dir):
    one = REQUIRED_TWO.split(", {")[0] + "]"
    matcher = _required_matcher(tiny_tokenizer_dir, False)
    assert matcher.accept_string(one) and matcher.is_completed()
    assert not _required_matcher(tiny_tokenizer_dir, False).accept_string(REQUIRED_TWO)
    assert not _required_matcher(tiny_tokenizer_dir, True).accept_string("[]")


def test_required_calls_stream_whole_at_the_end_and_a_cut_array_makes_none():
    parser = ChoiceOutputParser(tool_parser=RequiredCallsParser(TOOLS))
    calls, content = [], ""
    for k, ch in enumerate(REQUIRED_TWO):
        delta = parser.add(ch, finished=k == len(REQUIRED_TWO) - 1)
        calls += delta.tool_calls
        content += delta.content
        assert k == len(REQUIRED_TWO) - 1 or not delta.tool_calls
    assert content == "" and [c.name for c in calls] == ["get_weather", "write_file"]
    cut = ChoiceOutputParser(tool_parser=RequiredCallsParser(TOOLS)).parse(REQUIRED_TWO[:40])
    assert (cut.content, cut.tool_calls) == ("", [])


def test_required_schema_hoists_defs_and_refuses_two_different_ones_of_one_name():
    unit = {"type": "string", "enum": ["c", "f"]}
    functions = [{"name": "a", "parameters": {"type": "object", "properties": {"u": {"$ref": "#/$defs/Unit"}},
                                              "$defs": {"Unit": unit}}},
                 {"name": "b", "parameters": {"type": "object", "$defs": {"Unit": unit}}}]
    schema = required_calls_schema(functions, True)
    assert schema["$defs"] == {"Unit": unit}
    assert [set(alt["properties"]["parameters"]) for alt in schema["items"]["anyOf"]] == [{"type", "properties"},
                                                                                         {"type"}]
    functions[1]["parameters"]["$defs"] = {"Unit": {"type": "integer"}}
    with pytest.raises(ValueError, match=r"'\$defs/Unit' twice"):
        required_calls_schema(functions, True)


def test_call_cut_off_after_calls_is_not_content():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n\n<tool_c'
    parsed = ChoiceOutputParser(tool_parser=HermesToolParser(TOOLS)).parse(text)
    assert (parsed.content, _calls(parsed)) == ("", [("get_weather", {"city": "Oslo"})])
    assert _stream(ChoiceOutputParser(tool_parser=HermesToolParser(TOOLS)), list(text))[1] == ""
