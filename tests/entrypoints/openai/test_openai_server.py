"""The OpenAI-compatible server end to end: one real server subprocess (tiny random Llama,
--api-key) driven by the official openai SDK (sync and async) and raw httpx."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from remote_server import API_KEY, MAX_MODEL_LEN, running_server, server_model  # noqa: F401 (fixture)

MODEL = "tiny-llama"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "人工智能正在改变世界。Hello 😀"}]
GREEDY = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(server_model, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("openai_server") / "server.log"
    yield from running_server(server_model, ["--api-key", API_KEY, "--served-model-name", MODEL,
                                             "--allowed-origins", '["http://app.example"]',
                                             "--trust-request-chat-template"], log)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(server, path: str, body=None, headers=AUTH, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120, **kwargs)


def metrics(server) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of every tengyun: sample."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("tengyun:")}


def metric(values: dict, name: str, **labels) -> float:
    return values[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


def wait_for(predicate, what: str, timeout: float = 120.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def wait_idle(server) -> dict:
    """Poll /metrics until nothing runs or waits and no KV block is held."""
    def idle():
        values = metrics(server)
        busy = (metric(values, "tengyun:num_requests_running"), metric(values, "tengyun:num_requests_waiting"),
                metric(values, "tengyun:kv_cache_usage_perc"))
        return values if busy == (0, 0, 0) else None

    return wait_for(idle, "the engine to go idle")


# ----- answers ---------------------------------------------------------------------------
def _chat_sync(client, stream: bool, **kw):
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kw):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


def _completion_sync(client, stream: bool, **kw):
    if not stream:
        r = client.completions.create(model=MODEL, prompt=PROMPT, **kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **kw):
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
    return text, reason


async def _chat_async(client, stream: bool, **kw):
    if not stream:
        r = await client.chat.completions.create(model=MODEL, messages=MESSAGES, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = "", None
    async for chunk in await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kw):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


async def _completion_async(client, stream: bool, **kw):
    if not stream:
        r = await client.completions.create(model=MODEL, prompt=PROMPT, **kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, reason = "", None
    async for chunk in await client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **kw):
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streamed_text_joins_to_the_non_streamed_text_sync(client, kind):
    ask = _chat_sync if kind == "chat" else _completion_sync
    full = ask(client, False, **GREEDY)
    assert full[1] == "length" and full[0]
    assert ask(client, True, **GREEDY) == full


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streamed_text_joins_to_the_non_streamed_text_async(server, client, kind):
    ask = _chat_async if kind == "chat" else _completion_async
    sync_answer = (_chat_sync if kind == "chat" else _completion_sync)(client, False, **GREEDY)

    async def both():
        async with async_client(server) as aclient:
            return await ask(aclient, False, **GREEDY), await ask(aclient, True, **GREEDY)

    full, streamed = asyncio.run(both())
    assert full == streamed == sync_answer


def test_non_streamed_answers_carry_usage(server, client):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    tokens = post(server, "/tokenize", {"messages": MESSAGES}).json()
    assert chat.usage.prompt_tokens == tokens["count"]
    assert chat.usage.completion_tokens == 24
    assert chat.usage.total_tokens == tokens["count"] + 24
    assert chat.object == "chat.completion" and chat.model == MODEL and chat.choices[0].message.role == "assistant"
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert (completion.usage.completion_tokens, completion.object) == (5, "text_completion")


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_usage_chunk_only_with_include_usage(server, client, kind):
    create = client.chat.completions.create if kind == "chat" else client.completions.create
    args = dict(messages=MESSAGES) if kind == "chat" else dict(prompt=PROMPT)
    full = create(model=MODEL, **args, **GREEDY)
    chunks = list(create(model=MODEL, **args, stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    # Without include_usage no chunk has a usage key at all (raw SSE).
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body = {"model": MODEL, **args, "stream": True, "temperature": 0, "max_tokens": 4}
    with httpx.stream("POST", server.url + path, json=body, headers=AUTH, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert all("usage" not in json.loads(e) for e in events[:-1])


def test_n2_gives_two_choices_streamed_and_not(client):
    kw = dict(model=MODEL, n=2, temperature=1.0, seed=7, max_tokens=8, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(messages=MESSAGES, **kw)
    assert [c.index for c in full.choices] == [0, 1]
    assert full.usage.completion_tokens == 16
    texts, reasons = {0: "", 1: ""}, {}
    for chunk in client.chat.completions.create(messages=MESSAGES, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                assert c.index not in reasons, "finish_reason sent twice"
                reasons[c.index] = c.finish_reason
    assert reasons == {0: "length", 1: "length"}
    assert texts == {c.index: c.message.content for c in full.choices}  # seeded: same draws
    completion = client.completions.create(prompt=[PROMPT, "Paris is"], **kw)
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]  # prompt index * n + i
    texts, reasons = {i: "" for i in range(4)}, {}
    for chunk in client.completions.create(prompt=[PROMPT, "Paris is"], stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                assert c.index not in reasons, "finish_reason sent twice"
                reasons[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in completion.choices}
    assert reasons == {i: "length" for i in range(4)}


def test_stop_string_cuts_the_text_streamed_and_not(client):
    reference = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=40,
                                          extra_body={"ignore_eos": True}).choices[0].text
    stop = next(reference[i:i + 2] for i in range(4, len(reference) - 2)
                if "\ufffd" not in reference[i:i + 2] and reference[i:i + 2].strip())
    expected = reference[:reference.index(stop)]
    kw = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=40, stop=[stop], extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0]
    assert (full.text, full.finish_reason, full.model_extra["stop_reason"]) == (expected, "stop", stop)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == expected


def test_chat_logprobs_shapes(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 24
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert entry.logprob == pytest.approx(values[0])  # greedy: the sampled token is the top one
        assert entry.bytes == list(entry.token.encode())
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=3,
                                                stream=True, **GREEDY):
        for c in chunk.choices:
            streamed += c.logprobs.content if c.logprobs else []
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_completion_logprobs_shapes(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and value <= 0  # top-2 plus the sampled token, which greedy repeats
        assert max(top.values()) == pytest.approx(value)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]


def test_echo_prepends_the_prompt(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, **GREEDY)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    assert r.choices[0].text == PROMPT + plain.choices[0].text


def test_models_version_tokenize_detokenize(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server.url + "/version").json()["version"]
    tokens = post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}


def test_chat_template_kwargs_reach_the_template(server):
    body = {"messages": [{"role": "user", "content": "abc"}], "add_special_tokens": False,
            "chat_template": "{{ greeting }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}",
            "chat_template_kwargs": {"greeting": "Hi"}}
    tokens = post(server, "/tokenize", body).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": tokens}).json()["prompt"] == "Hi[abc]"


# ----- auth and CORS ---------------------------------------------------------------------
def test_wrong_or_missing_key_is_401_but_health_and_metrics_stay_open(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert info.value.status_code == 401
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": API_KEY},
                    {"Authorization": "Bearer sk-\u00e9t\u00e9".encode()}):
        for path in ("/v1/completions", "/tokenize", "/detokenize"):
            r = post(server, path, {"prompt": "x", "tokens": [1]}, headers=headers)
            assert r.status_code == 401
            assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "AuthenticationError",
                                          "param": None, "code": 401}}
        assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_cors_preflight_needs_no_key(server):
    r = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    assert "POST" in r.headers["access-control-allow-methods"]
    denied = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in denied.headers


# ----- errors ----------------------------------------------------------------------------
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BAD_REQUESTS = [
    # (id, path, body, param, words in the message)
    ("too-long", COMPLETIONS, {"model": MODEL, "prompt": [5] * 2000, "max_tokens": 100}, "max_tokens",
     [str(MAX_MODEL_LEN), "2100", "2000", "100", "max_tokens"]),
    ("prompt-fills-context", COMPLETIONS, {"prompt": [5] * MAX_MODEL_LEN, "max_tokens": None}, "prompt",
     [str(MAX_MODEL_LEN)]),
    ("chat-too-long", CHAT, {"messages": MESSAGES, "max_tokens": MAX_MODEL_LEN}, "max_tokens",
     [str(MAX_MODEL_LEN), "max_tokens"]),
    ("temperature", CHAT, {"messages": MESSAGES, "temperature": -1}, "temperature", ["temperature"]),
    ("top_p", COMPLETIONS, {"prompt": "x", "top_p": 1.5}, "top_p", ["top_p"]),
    ("top_k", COMPLETIONS, {"prompt": "x", "top_k": -5}, "top_k", ["top_k"]),
    ("n", CHAT, {"messages": MESSAGES, "n": 0}, "n", ["n must be"]),
    ("presence_penalty", CHAT, {"messages": MESSAGES, "presence_penalty": 3}, "presence_penalty", ["[-2, 2]"]),
    ("min_tokens", COMPLETIONS, {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, "min_tokens", ["min_tokens"]),
    ("max_tokens", COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens", ["max_tokens"]),
    ("wrong-type", COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature", ["temperature"]),
    ("missing-messages", CHAT, {"model": MODEL}, "messages", ["messages", "required"]),
    ("empty-messages", CHAT, {"messages": []}, None, ["messages"]),
    ("empty-prompt", COMPLETIONS, {"prompt": ""}, None, ["Either prompt or prompt_embeds must be provided"]),
    ("token-out-of-vocab", COMPLETIONS, {"prompt": [1, 99999]}, "prompt", ["99999"]),
    ("top_logprobs", CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 50}, "top_logprobs",
     ["top_logprobs", "--max-logprobs is 20"]),
    ("stream_options-without-stream", CHAT, {"messages": MESSAGES, "stream_options": {"include_usage": True}},
     None, ["stream_options"]),
    ("bad-stream-request", CHAT, {"messages": MESSAGES, "stream": True, "top_p": 0}, "top_p", ["top_p"]),
    ("image-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages", ["image_url"]),
]


def assert_error(r: httpx.Response, status: int, param=None, words=()) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert error["code"] == status and error["param"] == param and isinstance(error["type"], str)
    for word in words:
        assert word in error["message"]
    return error


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_400_in_openai_shape(server, case):
    _, path, body, param, words = case
    error = assert_error(post(server, path, body), 400, param, words)
    assert error["type"] == "BadRequestError"


def test_malformed_json_is_400(server):
    r = httpx.post(server.url + CHAT, content=b'{"messages": [', timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert "JSON" in assert_error(r, 400)["message"]


def test_non_finite_numbers_are_400(server):
    r = httpx.post(server.url + COMPLETIONS, content=b'{"prompt": "x", "temperature": NaN}', timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert_error(r, 400, "temperature", ["temperature"])


def test_unknown_route_is_404_and_wrong_method_405(server):
    assert_error(httpx.get(server.url + "/nope"), 404)
    assert_error(httpx.post(server.url + "/v1/nope", headers=AUTH), 404)
    assert_error(httpx.get(server.url + COMPLETIONS, headers=AUTH), 405)


def test_unknown_model_is_404_as_in_vllm(server, client):
    error = assert_error(post(server, CHAT, {"model": "gpt-4", "messages": MESSAGES}), 404, "model", ["gpt-4", MODEL])
    assert error["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert info.value.status_code == 404 and "no-such-model" in info.value.message


def test_sdk_raises_bad_request_with_the_message(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", top_p=1.5)
    assert info.value.status_code == 400 and "top_p" in info.value.message


def test_bad_requests_do_not_disturb_a_running_stream(server, client):
    reference = _completion_sync(client, False, **GREEDY)

    async def run():
        async with async_client(server) as aclient, httpx.AsyncClient(timeout=120, headers=AUTH) as http:
            good = asyncio.create_task(_completion_async(aclient, True, **GREEDY))
            bad = [http.post(server.url + path, json=body) for _, path, body, _, _ in BAD_REQUESTS]
            statuses = [r.status_code for r in await asyncio.gather(*bad)]
            return await good, statuses

    answer, statuses = asyncio.run(run())
    assert answer == reference and set(statuses) == {400}


# ----- disconnects, metrics, load --------------------------------------------------------
def aborts(values: dict) -> float:
    return metric(values, "tengyun:request_success_total", finished_reason="abort")


def test_client_disconnect_mid_stream_aborts_and_frees_kv(server):
    before = wait_idle(server)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + COMPLETIONS, json=body, headers=AUTH, timeout=120) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        running = metrics(server)
        assert metric(running, "tengyun:num_requests_running") == 1
        assert metric(running, "tengyun:kv_cache_usage_perc") > 0
    # Leaving the block closed the connection mid-stream.
    wait_for(lambda: aborts(metrics(server)) > aborts(before), "the abort to be counted")
    after = wait_idle(server)
    assert aborts(after) == aborts(before) + 1
    assert metric(after, "tengyun:generation_tokens_total") - metric(before, "tengyun:generation_tokens_total") < 1000


def test_client_disconnect_during_non_streamed_request_aborts(server):
    before = wait_idle(server)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as http:
            task = asyncio.create_task(http.post(server.url + COMPLETIONS, json=body))
            while metric(await asyncio.to_thread(metrics, server), "tengyun:num_requests_running") == 0:
                assert not task.done(), task.result().text
                await asyncio.sleep(0.05)
            task.cancel()  # closes the connection

    asyncio.run(run())
    wait_for(lambda: aborts(metrics(server)) > aborts(before), "the abort to be counted")
    assert aborts(wait_idle(server)) == aborts(before) + 1


def test_metrics_parse_and_counters_move(server, client):
    before = wait_idle(server)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = wait_idle(server)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("tengyun:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("tengyun:generation_tokens_total") == 7
    assert delta("tengyun:request_success_total", finished_reason="length") == 1
    assert delta("tengyun:prefix_cache_queries_total") == r.usage.prompt_tokens
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"tengyun:{histogram}_count") == 1
    assert delta("tengyun:inter_token_latency_seconds_count") == 6
    names = {name for name, _ in after}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hits_total",
                 "num_preemptions_total"):
        assert f"tengyun:{name}" in names


def test_32_concurrent_streaming_clients_get_their_greedy_answers(server, client):
    prompts = [f"{PROMPT} {i} jumps over the lazy dog number {i * 7}" for i in range(32)]
    kw = dict(model=MODEL, temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    expected = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]

    async def one(aclient, prompt):
        parts, reasons = [], []
        async for chunk in await aclient.completions.create(prompt=prompt, stream=True, **kw):
            parts += [c.text for c in chunk.choices]
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
        return "".join(parts), reasons

    async def run():
        async with async_client(server) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(run())
    assert [text for text, _ in results] == expected
    assert all(reasons == ["length"] for _, reasons in results)
    wait_idle(server)
