"""Tool calls, reasoning content and structured output end to end: the real SmolLM2-135M-Instruct
behind `--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`, driven by the
official openai SDK. Constrained decoding makes even this small model's calls and JSON valid."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from remote_server import running_server

pytestmark = pytest.mark.slow

MODEL = "smollm2"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "London", "Tokyo"]}}}
WEATHER = {"type": "object", "required": ["city", "days"],
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "required": ["tz"], "properties": {"tz": {"enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What's the weather in Paris for the next 3 days?"}]
# Qwen3-style templates: the model opens <think> itself (thinking off: the prompt holds an empty one),
# or the prompt opens it and the model only closes it (Qwen3-2507 thinking releases).
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
OPEN_THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for tc in m.get('tool_calls', []) %}<tool_call>\n{\"name\": \"{{ tc['function']['name'] }}\", "
    "\"arguments\": {{ tc['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
REASONING = r"[a-z]+( [a-z]+){1,5}"
ANSWER = r"[A-Z][a-z]+( [a-z]+){1,5}\."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("tools_server") / "server.log"
    yield from running_server("HuggingFaceTB/SmolLM2-135M-Instruct", [
        "--served-model-name", MODEL, "--kv-cache-memory", "256MiB", "--max-model-len", "2048",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
        "--trust-request-chat-template",  # the tests bring their own templates
        "--dtype", "float32",  # a whole answer and its stream (a prefix-cache hit) agree on every greedy near-tie
    ], log, env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, **{"messages": ASK, **kwargs})


def streamed(client, **kwargs) -> dict:
    """One choice's stream folded up: reasoning, content, tool calls by index, finish reason, usage."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None, "usage": None}
    for chunk in chat(client, stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            out["content"] += delta.content or ""
            for call in delta.tool_calls or []:
                entry = out["calls"].setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = entry["id"] or call.id
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


# ----- structured output -------------------------------------------------------------------
def test_twenty_json_schema_answers_all_validate(server):
    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*[aclient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}], seed=i,
                temperature=1.0, max_tokens=80,
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
                for i in range(20)])

    answers = asyncio.run(run())
    for answer in answers:
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)


def test_json_object_choice_and_regex_constraints(client):
    answer = chat(client, response_format={"type": "json_object"}, temperature=0, max_tokens=120)
    assert isinstance(json.loads(answer.choices[0].message.content), dict)
    answer = chat(client, extra_body={"guided_choice": ["sunny", "rainy"]}, temperature=1.0, seed=3)
    assert answer.choices[0].message.content in ("sunny", "rainy")
    answer = chat(client, extra_body={"structured_outputs": {"regex": r"[0-9]{2}-[a-z]{3}"}}, temperature=1.0)
    assert re.fullmatch(r"[0-9]{2}-[a-z]{3}", answer.choices[0].message.content)
    completion = client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=10,
                                           extra_body={"guided_choice": ["sunny", "rainy"]})
    assert completion.choices[0].text in ("sunny", "rainy")


@pytest.mark.parametrize("body, param, message", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "foo"}}}),
     "response_format", 'does not compile: Unsupported type "foo"'),
    (dict(guided_regex="[a-"), "guided_regex", "does not compile: .*Unclosed"),
    (dict(guided_json=PERSON, guided_regex="a"), "guided_regex", "at most one output constraint"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), None,
     "names the function 'nope', which is not in tools"),
    (dict(tool_choice="required"), None, "tool_choice needs tools"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format",
     "already constrains the output"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_are_400_naming_the_problem(server, body, param, message, stream):
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": ASK, "stream": stream, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert re.search(message, error["message"]), error
    if param:
        assert error["param"] == param


# ----- tool calls ----------------------------------------------------------------------------
def test_named_tool_choice_returns_a_valid_call_and_the_stream_gives_the_same(client):
    forced = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  temperature=0, max_tokens=80)
    choice = chat(client, **forced).choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's and vLLM's finish for a named call
    assert choice.message.content == ""  # as vLLM answers a forced call (null only beside calls the model chose)
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    stream = streamed(client, **forced)
    assert stream["finish"] == "stop" and stream["content"] == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in stream["calls"].values()] == \
        [("get_weather", json.loads(call.function.arguments))]
    assert stream["usage"].completion_tokens > 0


def test_required_tool_choice_calls_one_of_the_tools(client):
    choice = chat(client, messages=[{"role": "user", "content": "What time is it in Berlin?"}], tools=TOOLS,
                  tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=7,
                  max_tokens=80).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    [call] = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_off_by_max_tokens_leaks_no_markup(client, stream):
    forced = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  temperature=0, max_tokens=6)
    if stream:
        answer = streamed(client, **forced)
        content, calls, finish = answer["content"], answer["calls"], answer["finish"]
    else:
        choice = chat(client, **forced).choices[0]
        content, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
    assert finish == "length" and not calls and "<tool" not in content and "{" not in content


HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", '
               r'"arguments": \{"city": "[A-Z][a-z]{2,8}", "days": [1-7]\}\}\n</tool_call>')


def test_auto_tool_choice_parses_the_models_hermes_call_whole_and_streamed(client):
    # The regex makes the small model write Qwen's <tool_call> markup, as Qwen would unprompted.
    kwargs = dict(tools=TOOLS, temperature=0, max_tokens=60, extra_body={"guided_regex": HERMES_CALL})
    choice = chat(client, **kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    stream = streamed(client, **kwargs)
    assert "<tool_call>" not in stream["content"] and stream["finish"] == "tool_calls"
    assert [json.loads(c["arguments"]) for c in stream["calls"].values()] == [json.loads(call.function.arguments)]


def test_malformed_call_json_comes_back_as_content_not_an_error(client):
    broken = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}"\}\n</tool_call>'
    choice = chat(client, tools=TOOLS, temperature=0, max_tokens=60, extra_body={"guided_regex": broken}).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert re.fullmatch(broken, choice.message.content)


def test_tool_choice_none_leaves_markup_unparsed(client):
    choice = chat(client, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=60,
                  extra_body={"guided_regex": HERMES_CALL}).choices[0]
    assert choice.message.content.startswith("<tool_call>") and not choice.message.tool_calls


def test_tool_results_go_through_the_chat_template(server, client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ]
    rendered = httpx.post(server.url + "/tokenize", timeout=60, json={
        "messages": messages, "tools": TOOLS, "chat_template": TOOL_TEMPLATE, "return_token_strs": False}).json()
    prompt = httpx.post(server.url + "/detokenize", json={"tokens": rendered["tokens"]}, timeout=60).json()["prompt"]
    assert '"arguments": {"city": "Paris", "days": 3}' in prompt  # an object for the template, not a string
    assert "<|im_start|>tool\nSunny, 24 C<|im_end|>" in prompt and '"name": "get_time"' in prompt
    answer = chat(client, messages=messages, tools=TOOLS, temperature=0, max_tokens=16,
                  extra_body={"chat_template": TOOL_TEMPLATE})
    assert isinstance(answer.choices[0].message.content, str)


# ----- reasoning -----------------------------------------------------------------------------
def test_reasoning_is_split_from_content_whole_and_streamed(client):
    pattern = rf"<think>\n{REASONING}\n</think>\n\n{ANSWER}"  # makes the small model think in Qwen3's markup
    kwargs = dict(temperature=0, max_tokens=80, extra_body={"chat_template": THINK_TEMPLATE, "guided_regex": pattern})
    message = chat(client, **kwargs).choices[0].message
    assert re.fullmatch(REASONING, message.reasoning_content), message
    assert message.reasoning == message.reasoning_content
    assert re.fullmatch(ANSWER, message.content), message
    stream = streamed(client, **kwargs)
    assert (stream["reasoning"], stream["content"]) == (message.reasoning_content, message.content)


def test_prompt_opened_think_makes_the_output_reasoning_until_it_closes(client):
    kwargs = dict(temperature=0, max_tokens=12, extra_body={"chat_template": OPEN_THINK_TEMPLATE})
    message = chat(client, **kwargs).choices[0].message
    assert message.reasoning_content and message.content == ""
    stream = streamed(client, **kwargs)
    assert (stream["reasoning"], stream["content"]) == (message.reasoning_content, "")


def test_thinking_disabled_gives_string_content_and_no_reasoning(client):
    kwargs = dict(temperature=0, max_tokens=16, extra_body={
        "chat_template": THINK_TEMPLATE, "chat_template_kwargs": {"enable_thinking": False}})
    message = chat(client, **kwargs).choices[0].message
    assert isinstance(message.content, str) and message.content and message.reasoning_content is None
    stream = streamed(client, **kwargs)
    assert (stream["reasoning"], stream["content"]) == ("", message.content)


def test_include_reasoning_false_drops_it(client):
    pattern = rf"<think>\n{REASONING}\n</think>\n\n{ANSWER}"
    message = chat(client, temperature=0, max_tokens=80, extra_body={
        "chat_template": THINK_TEMPLATE, "guided_regex": pattern, "include_reasoning": False}).choices[0].message
    assert message.reasoning_content is None and re.fullmatch(ANSWER, message.content)


def test_auto_tool_choice_flag_needs_a_parser(capsys):
    from tengyun.entrypoints.openai.api_server import main

    assert main(["--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
