"""The Responses API on the real SmolLM2-135M-Instruct behind `--enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser qwen3`, driven by the official openai SDK: text.format
json_schema through structured output (the text validates against the schema; responses.parse
reads it), a forced function tool call as a function_call output item, whole and streamed, and
its function_call_output sent back under previous_response_id."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from remote_server import running_server

pytestmark = pytest.mark.slow

MODEL = "smollm2"
EVENT = {"type": "object", "additionalProperties": False, "required": ["name", "date", "participants"],
         "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 30},
                        "date": {"type": "string", "minLength": 1, "maxLength": 20},
                        "participants": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                         "minItems": 1, "maxItems": 3}}}
WEATHER = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast for a city",
          "parameters": WEATHER}]
ASK = "What's the weather in Paris for the next 3 days?"


class CalendarEvent(BaseModel):
    name: str = Field(max_length=30)
    date: str = Field(max_length=20)
    participants: list[str] = Field(max_length=3)  # a 135M model left unbounded repeats a name forever


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log = tmp_path_factory.mktemp("responses_smollm2") / "server.log"
    for server in running_server("HuggingFaceTB/SmolLM2-135M-Instruct", [
            "--served-model-name", MODEL, "--kv-cache-memory", "256MiB", "--max-model-len", "2048",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
            "--dtype", "float32"], log, env={"OMP_NUM_THREADS": "1"}):
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_text_format_json_schema_gives_text_valid_against_it(client):
    response = client.responses.create(
        model=MODEL, instructions="Extract the event information.",
        input="Alice and Bob are going to a science fair on Friday.", max_output_tokens=120, temperature=0,
        text={"format": {"type": "json_schema", "name": "calendar_event", "schema": EVENT, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), EVENT)
    assert response.text.format.type == "json_schema"


def test_responses_parse_reads_a_pydantic_model(client):
    response = client.responses.parse(model=MODEL, instructions="Extract the event information.",
                                      input="Alice and Bob are going to a science fair on Friday.",
                                      text_format=CalendarEvent, max_output_tokens=120, temperature=0)
    assert isinstance(response.output_parsed, CalendarEvent)


def test_streamed_structured_output_equals_the_final_text(client):
    kw = dict(model=MODEL, input="Alice and Bob meet on Monday.", max_output_tokens=120, temperature=0,
              text={"format": {"type": "json_schema", "name": "event", "schema": EVENT}})
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    final = events[-1].response
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == final.output_text
    jsonschema.validate(json.loads(streamed), EVENT)


def test_a_required_tool_call_is_a_function_call_item_and_its_output_continues(client):
    # parallel_tool_calls off: greedy SmolLM2 repeats the same call until max_output_tokens otherwise
    first = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=100, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=TOOLS, tool_choice="none", max_output_tokens=30,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 C"}])
    assert second.output[-1].type == "message" and second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens


def test_a_named_tool_call_streams_as_function_call_events(client):
    kw = dict(model=MODEL, input=ASK, tools=TOOLS, max_output_tokens=100, temperature=0,
              tool_choice={"type": "function", "name": "get_weather"})
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds
    final = events[-1].response
    calls = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [
        (c.name, c.arguments) for c in whole.output if c.type == "function_call"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == calls[0].arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER)
