"""The Responses API (/v1/responses) on the real server over a tiny random Llama, driven by the
official openai SDK: whole and streamed answers (typed events, streamed text equal to the final
output), the conversation it builds from input items, instructions and previous_response_id
(checked token for token against /tokenize of the equivalent chat messages), store / retrieve /
background / cancel, reasoning items (--reasoning-parser deepseek_r1), auth and 400s naming the
field. The SmolLM2 tests (structured output, tool calls) are in test_responses_smollm2.py."""

from __future__ import annotations

import httpx
import openai
import pytest

from remote_server import API_KEY, running_server, server_model  # noqa: F401 (fixtures)

MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(server_model, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("responses") / "server.log"
    yield from running_server(server_model, ["--served-model-name", MODEL, "--api-key", API_KEY,
                                             "--dtype", "float32"], log)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def tokens_of(server, messages: list[dict]) -> int:
    """How many prompt tokens the chat template makes of these chat messages."""
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_a_string_input_answers_one_message_with_usage(client, server):
    response = client.responses.create(model=MODEL, input="The quick brown fox", max_output_tokens=6,
                                       temperature=0)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.output[0].id.startswith("msg_")
    assert [item.type for item in response.output] == ["message"]
    assert response.output[0].content[0].type == "output_text" and response.output_text
    usage = response.usage
    assert usage.input_tokens == tokens_of(server, [{"role": "user", "content": "The quick brown fox"}])
    assert 1 <= usage.output_tokens <= 6 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    if usage.output_tokens == 6:  # cut by max_output_tokens, not ended by EOS
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


def test_streamed_events_come_in_order_and_join_to_the_final_text(client):
    kw = dict(model=MODEL, input="The quick brown fox", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == final.output_text == events[-4].text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == whole.status


def test_stream_true_without_the_helper_reads_the_same_events(client):
    events = list(client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert events[-1].response.output_text == "".join(
        e.delta for e in events if e.type == "response.output_text.delta")


def test_include_output_logprobs_gives_the_chat_paths_token_logprobs_whole_and_streamed(client):
    kw = dict(model=MODEL, input="The quick brown fox", max_output_tokens=5, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": kw["input"]}],
                                          max_completion_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    want = [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs])
            for c in chat.choices[0].logprobs.content]
    response = client.responses.create(include=["message.output_text.logprobs"], top_logprobs=3, **kw)
    got = response.output[-1].content[0].logprobs
    assert response.top_logprobs == 3 and len(want) == response.usage.output_tokens
    assert [(g.token, g.logprob, [(t.token, t.logprob) for t in g.top_logprobs]) for g in got] == want
    assert all(g.bytes == list(g.token.encode()) for g in got)
    with client.responses.stream(include=["message.output_text.logprobs"], top_logprobs=3, **kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs])
                for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    # in order; a token without text of its own (part of a character) waits for the next delta
    assert streamed == want[:len(streamed)]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs]) for lp in done.logprobs] == want
    assert final.output[-1].content[0].logprobs == got
    plain = client.responses.create(**kw)  # not asked for: none, and top_logprobs not echoed
    assert plain.output[-1].content[0].logprobs == [] and plain.top_logprobs is None


def test_instructions_and_input_items_become_the_chat_messages(client, server):
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        {"role": "user", "content": "Thanks"},
    ]
    response = client.responses.create(model=MODEL, instructions="Answer in French.", input=items,
                                       max_output_tokens=2)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert response.usage.input_tokens == tokens_of(server, [
        {"role": "system", "content": "Answer in French."}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather ?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks"}])
    assert response.instructions == "Answer in French."


def test_previous_response_id_continues_the_conversation_without_its_instructions(client, server):
    first = client.responses.create(model=MODEL, instructions="Be brief.", input="One", max_output_tokens=3,
                                    temperature=0)
    second = client.responses.create(model=MODEL, input="Two", previous_response_id=first.id, max_output_tokens=3,
                                     temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == tokens_of(server, [
        {"role": "user", "content": "One"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Two"}])
    third = client.responses.create(model=MODEL, input="Three", previous_response_id=second.id, max_output_tokens=3)
    assert third.usage.input_tokens == tokens_of(server, [
        {"role": "user", "content": "One"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Two"}, {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Three"}])


def test_store_keeps_the_response_and_store_false_does_not(client):
    kept = client.responses.create(model=MODEL, input="Keep me", max_output_tokens=3)
    again = client.responses.retrieve(kept.id)
    assert again.model_dump() == kept.model_dump()
    dropped = client.responses.create(model=MODEL, input="Drop me", max_output_tokens=3, store=False)
    assert dropped.store is False
    with pytest.raises(openai.NotFoundError, match="Response with id .* not found."):
        client.responses.retrieve(dropped.id)
    with pytest.raises(openai.NotFoundError, match="Response with id .* not found."):
        client.responses.create(model=MODEL, input="x", previous_response_id=dropped.id)


def test_background_runs_after_the_answer_and_is_retrieved(client):
    queued = client.responses.create(model=MODEL, input="Later", max_output_tokens=4, background=True,
                                     temperature=0)
    assert queued.status == "queued" and queued.output == []
    response = queued
    for _ in range(600):  # polls as vLLM's test does: "queued" until it ends (no in_progress); no time limit
        response = client.responses.retrieve(queued.id)
        if response.status != "queued":
            break
    assert response.status in ("completed", "incomplete") and response.output[-1].type == "message"
    whole = client.responses.create(model=MODEL, input="Later", max_output_tokens=4, temperature=0)
    assert response.output_text == whole.output_text and response.usage.output_tokens == whole.usage.output_tokens
    with pytest.raises(openai.BadRequestError, match="background can only be used when `store` is true"):
        client.responses.create(model=MODEL, input="x", background=True, store=False)
    with pytest.raises(openai.BadRequestError, match=f"Response {queued.id} is already {response.status}: only"):
        client.responses.cancel(queued.id)


def test_vllms_sampling_extras_reach_the_engine_as_on_chat(client):
    """ignore_eos, logit_bias and repetition_penalty (vLLM's ResponsesRequest extras): the answer
    equals chat's with the same fields."""
    extras = {"ignore_eos": True, "logit_bias": {"42": 100}, "repetition_penalty": 1.0}
    response = client.responses.create(model=MODEL, input="The quick brown fox", max_output_tokens=7, temperature=0,
                                       extra_body=extras)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "The quick brown fox"}],
                                          max_tokens=7, temperature=0, extra_body=extras)
    assert response.usage.output_tokens == chat.usage.completion_tokens == 7
    assert response.output_text == chat.choices[0].message.content and response.status == "incomplete"
    for field, value in (("logit_bias", {"1000000": 1}), ("repetition_penalty", 0)):
        with pytest.raises(openai.BadRequestError, match=field):
            client.responses.create(model=MODEL, input="x", extra_body={field: value})


def test_background_stream_runs_on_without_its_reader_and_replays_after_a_sequence_number(client):
    kw = dict(model=MODEL, input="The quick brown fox", max_output_tokens=8, temperature=0)
    first = client.responses.create(background=True, stream=True, **kw)
    created = next(iter(first))  # the POST's reader leaves after one event; the run goes on
    first.close()
    response_id = created.response.id
    events = list(client.responses.retrieve(response_id, stream=True))  # from the start, to the end
    assert events[0] == created and events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert list(client.responses.retrieve(response_id, stream=True, starting_after=2)) == events[3:]
    stored = client.responses.retrieve(response_id)
    whole = client.responses.create(**kw)
    assert stored.status == events[-1].response.status and stored.output_text == whole.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    with pytest.raises(openai.BadRequestError, match="no events to replay"):
        list(client.responses.retrieve(whole.id, stream=True))
    story = client.responses.create(model=MODEL, input="A long story", max_output_tokens=1500, background=True,
                                    stream=True, extra_body={"temperature": 1.0, "ignore_eos": True})
    reader = iter(story)
    story_id = next(reader).response.id
    assert client.responses.cancel(story_id).status == "cancelled"
    assert all(e.type != "response.completed" for e in reader)  # the reader ends with the run
    assert client.responses.retrieve(story_id).status == "cancelled"


def test_cancel_stops_a_background_response_and_frees_its_sequence(client, server):
    queued = client.responses.create(model=MODEL, input="A long story", max_output_tokens=1500, background=True,
                                     extra_body={"temperature": 1.0, "ignore_eos": True})
    assert client.responses.cancel(queued.id).status == "cancelled"
    assert client.responses.retrieve(queued.id).status == "cancelled"
    for _ in range(600):  # the engine drops the sequence (no KV blocks held)
        engine = httpx.get(server.url + "/health/detail", timeout=30).json()["engine"]
        if engine["running"] == 0 and engine["waiting"] == 0:
            break
    assert engine["running"] == 0 and engine["waiting"] == 0
    assert client.responses.retrieve(queued.id).status == "cancelled"
    done = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response."):
        client.responses.cancel(done.id)


@pytest.mark.parametrize("body, param, words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", ["input_image"]),
    ({"input": [{"type": "file_search_call"}]}, "input[0].type", ["file_search_call"]),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", ["web_search"]),
    ({"input": "x", "temperature": -1}, "temperature", ["temperature"]),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", ["max_output_tokens"]),
    ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens", ["max_output_tokens", "2048"]),
    ({"input": []}, None, ["input"]),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text", ["schema"]),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", ["tools"]),
    ({"model": "gpt-4", "input": "x"}, "model", ["gpt-4"]),
])
def test_bad_input_is_an_error_naming_the_field(server, body, param, words):
    r = httpx.post(server.url + "/v1/responses", json=body, headers=AUTH, timeout=60)
    assert r.status_code == (404 if param == "model" else 400), r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def test_the_routes_need_the_api_key(server):
    assert httpx.post(server.url + "/v1/responses", json={"input": "x"}, timeout=30).status_code == 401
    assert httpx.get(server.url + "/v1/responses/resp_1", timeout=30).status_code == 401
    assert httpx.post(server.url + "/v1/responses/resp_1/cancel", timeout=30).status_code == 401


def test_store_off_by_vllms_variable_ignores_store(server_model, tmp_path):  # noqa: F811
    log = tmp_path / "server.log"
    for server in running_server(server_model, ["--served-model-name", MODEL], log,
                                 env={"VLLM_ENABLE_RESPONSES_API_STORE": "0"}):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        response = client.responses.create(model=MODEL, input="x", max_output_tokens=2)
        assert response.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response.id)
        with pytest.raises(openai.BadRequestError, match="background"):
            client.responses.create(model=MODEL, input="x", background=True)


def test_reasoning_items_from_the_reasoning_parser(server_model, tmp_path):  # noqa: F811
    """deepseek_r1 reads a tiny model's whole answer as reasoning (it never closes </think>):
    a reasoning item, then an empty message, whole and streamed alike."""
    for server in running_server(server_model, ["--served-model-name", MODEL, "--reasoning-parser", "deepseek_r1",
                                                "--dtype", "float32"], tmp_path / "server.log"):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        kw = dict(model=MODEL, input="Think", max_output_tokens=8, temperature=0)
        whole = client.responses.create(**kw)
        assert [item.type for item in whole.output] == ["reasoning", "message"]
        thoughts = whole.output[0].content[0].text
        assert thoughts and whole.output_text == "" and whole.usage.output_tokens_details.reasoning_tokens > 0
        with client.responses.stream(**kw) as stream:
            events = list(stream)
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thoughts
        final = events[-1].response
        assert [item.type for item in final.output] == ["reasoning", "message"]
        assert final.output[0].content[0].text == thoughts


def test_the_store_is_bounded_least_recently_used_first_out():
    from tengyun.entrypoints.openai.responses_protocol import ResponsesResponse
    from tengyun.entrypoints.openai.responses_store import ResponsesStore, StoredResponse

    store = ResponsesStore(capacity=2, enabled=True)
    for name in ("a", "b"):
        store.put(StoredResponse(ResponsesResponse(id=name, model=MODEL, status="completed"), []))
    assert store.get("a") is not None  # now b is the least recently used
    store.put(StoredResponse(ResponsesResponse(id="c", model=MODEL, status="completed"), []))
    assert len(store) == 2 and store.get("b") is None and store.get("a") and store.get("c")
