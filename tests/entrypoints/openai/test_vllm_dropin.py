"""What a vLLM user's client expects of the server: stream shapes, vLLM's flags, routes and
headers. Real server subprocesses on loopback (tiny random Llama), the openai SDK and httpx."""

from __future__ import annotations

import contextlib
import json

import httpx
import openai
import pytest

from remote_server import running_server, server_model, start_server  # noqa: F401 (fixtures)

MODEL = "dropin"
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def server(server_model, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("dropin") / "server.log"
    yield from running_server(server_model, ["--served-model-name", MODEL], log)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def sse_events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


# ----- stream shapes -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_n3_streams_one_choice_per_chunk_and_joins_to_the_full_answer(client, kind):
    kw = dict(model=MODEL, n=3, temperature=1.0, seed=11, max_tokens=6, extra_body={"ignore_eos": True})
    create = client.chat.completions.create if kind == "chat" else client.completions.create
    io = dict(messages=MESSAGES) if kind == "chat" else dict(prompt="The quick brown fox")
    full = create(**io, **kw)
    texts = {0: "", 1: "", 2: ""}
    for chunk in create(**io, stream=True, **kw):
        assert len(chunk.choices) == 1  # a client reading choices[0] sees every choice's text
        choice = chunk.choices[0]
        texts[choice.index] += (choice.delta.content or "") if kind == "chat" else choice.text
    expected = {c.index: c.message.content if kind == "chat" else c.text for c in full.choices}
    assert texts == expected


def test_chat_role_chunk_comes_once_per_choice_first(server):
    body = {"messages": MESSAGES, "n": 2, "max_tokens": 3, "stream": True, "ignore_eos": True}
    events = sse_events(server, "/v1/chat/completions", body)
    roles = [(e["choices"][0]["index"], i) for i, e in enumerate(events) if "role" in e["choices"][0]["delta"]]
    assert sorted(index for index, _ in roles) == [0, 1]
    for index, position in roles:
        before = [e for e in events[:position] if e["choices"][0]["index"] == index]
        assert before == []


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": "The quick brown fox"}),
])
def test_continuous_usage_stats_put_usage_on_every_chunk(server, path, body):
    body = {**body, "max_tokens": 5, "n": 2, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse_events(server, path, body)
    assert all(e["usage"] is not None for e in events)
    completion = [e["usage"]["completion_tokens"] for e in events]
    assert completion == sorted(completion) and completion[-1] == 10
    last = events[-1]
    assert last["choices"] == [] and last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 10
    plain = sse_events(server, path, {**body, "stream_options": {"include_usage": True}})
    assert all(e["usage"] is None for e in plain[:-1]) and plain[-1]["usage"] == last["usage"]


def test_chat_stream_sends_nothing_while_its_request_waits_for_prefill(start_server):  # noqa: F811
    """With one sequence slot, B waits behind six long requests; B's stream (role chunk included)
    starts only once B runs, so a client's time to first chunk is its time to first token."""
    server = start_server("--max-num-seqs", "1").wait_ready()
    long_body = {"prompt": "a", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    body = {"messages": MESSAGES, "max_tokens": 2, "stream": True}
    with contextlib.ExitStack() as stack:
        http = stack.enter_context(httpx.Client(timeout=120))
        ahead = [stack.enter_context(http.stream("POST", server.url + "/v1/completions", json=long_body))
                 for _ in range(6)]
        next(ahead[0].iter_lines())  # the first is running, five wait
        b = stack.enter_context(httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                                             timeout=httpx.Timeout(120, read=1.5)))
        with pytest.raises(httpx.ReadTimeout):
            next(b.iter_lines())  # nothing while the others hold the only slot
    # Their streams closed (a disconnect aborts): a fresh B runs at once, role chunk first.
    events = sse_events(server, "/v1/chat/completions", body)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
