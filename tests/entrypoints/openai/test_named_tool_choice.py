"""A tool_choice naming a function generates only that call's arguments JSON, as vLLM 0.11 does
(the function's parameters schema constrains the whole output), and the server builds the call
from it: on SmolLM2 a two-field call takes about 15 tokens instead of the 63 of the `<tool_call>`
wrapper, so max_tokens 30 returns it whole. The parser: whole, streamed, cut off."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from remote_server import running_server
from tengyun.entrypoints.openai.chat_output import ChoiceOutputParser
from tengyun.entrypoints.openai.tool_parsers.named_call import NamedCallParser

MODEL = "smollm2"
WEATHER = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What's the weather in Paris for the next 3 days?"}]


def test_the_whole_output_is_the_named_calls_arguments():
    parsed = ChoiceOutputParser(None, NamedCallParser("get_weather")).parse('{"city": "Paris", "days": 3}')
    assert parsed.content == "" and [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("get_weather", '{"city": "Paris", "days": 3}')]


def test_streamed_the_call_goes_out_whole_at_the_end():
    parser, calls, content = ChoiceOutputParser(None, NamedCallParser("f")), [], ""
    text = '{"a": [1, 2]}'
    for k, ch in enumerate(text):
        delta = parser.add(ch, finished=k == len(text) - 1)
        calls += delta.tool_calls
        content += delta.content
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", text)]


def test_arguments_cut_off_make_no_call_and_no_content():
    parsed = ChoiceOutputParser(None, NamedCallParser("f")).parse('{"city": "Par')
    assert parsed.content == "" and parsed.tool_calls == []


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("named_tool_choice") / "server.log"
    yield from running_server("HuggingFaceTB/SmolLM2-135M-Instruct", [
        "--served-model-name", MODEL, "--kv-cache-memory", "256MiB", "--max-model-len", "2048",
        "--dtype", "float32"], log, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_named_call_costs_only_its_arguments_tokens(server, stream):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=30)
    if stream:
        calls, usage = {}, None
        for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
            usage = chunk.usage or usage
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    calls[call.index] = (call.function.name, call.function.arguments)
        [(name, arguments)] = calls.values()
    else:
        answer = client.chat.completions.create(**kw)
        [call] = answer.choices[0].message.tool_calls
        name, arguments, usage = call.function.name, call.function.arguments, answer.usage
        assert answer.choices[0].message.content == ""
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER)
    # the arguments' own tokens (the grammar may split them finer than the tokenizer would) and the
    # end-of-text token: about 15, where the <tool_call> wrapper took 63 and max_tokens 30 cut it
    count = httpx.post(server.url + "/tokenize", json={"prompt": arguments, "add_special_tokens": False},
                       timeout=60).json()["count"]
    assert count < usage.completion_tokens < 30
