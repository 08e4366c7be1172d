"""What a vLLM user's client expects of the server: stream shapes, vLLM's flags, routes and
headers. Real server subprocesses on loopback (tiny random Llama), the openai SDK and httpx."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import openai
import pytest

from remote_server import running_server, server_model, start_server  # noqa: F401 (fixtures)

MODEL = "dropin"
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
NO_EFFECT = ["--enable-log-requests", "--max-log-len", "100",
             "--swap-space", "4", "--disable-custom-all-reduce"]
FEATURES = ["--disable-frontend-multiprocessing", "--enable-request-id-headers", "--enable-server-load-tracking",
            "--enable-tokenizer-info-endpoint",
            "--enable-prompt-tokens-details", "--return-tokens-as-token-ids", "--runner", "generate",
            "--root-path", "/llm",
            "--limit-mm-per-prompt", '{"image": 0}']


@pytest.fixture(scope="module")
def server(server_model, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("dropin") / "server.log"
    yield from running_server(server_model, ["--served-model-name", MODEL, *NO_EFFECT, *FEATURES], log)


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
    if path == "/v1/chat/completions":  # as vLLM: the role chunk counts no completion token yet
        assert "role" in events[0]["choices"][0]["delta"] and events[0]["usage"]["completion_tokens"] == 0
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
        first_lines = ahead[0].iter_lines()  # kept: a dropped line iterator closes the stream
        next(first_lines)  # the first is running, five wait
        b = stack.enter_context(httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                                             timeout=httpx.Timeout(120, read=1.5)))
        with pytest.raises(httpx.ReadTimeout):
            next(b.iter_lines())  # nothing while the others hold the only slot
    # Their streams closed (a disconnect aborts): a fresh B runs at once, role chunk first.
    events = sse_events(server, "/v1/chat/completions", body)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


# ----- vLLM's flags ------------------------------------------------------------------------
def test_flags_without_effect_start_the_server_with_one_log_line_each(server):
    log = server.log()
    for flag in (f for f in NO_EFFECT if f.startswith("--")):
        assert log.count(f"{flag} accepted for vLLM compatibility; it has no effect here") == 1


def test_disable_frontend_multiprocessing_keeps_the_engine_in_the_server_process(server):
    assert "Engine: in a thread of the server process (--disable-frontend-multiprocessing)" in server.log()
    assert "Engine: in process" not in server.log()


@pytest.mark.parametrize("flags, words", [
    (["--enable-lora", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
     ["--speculative-config with --enable-lora is not supported"]),
    (["--lora-modules", "sql=/adapters/sql"], ["--lora-modules needs --enable-lora"]),
    (["--enable-lora", "--lora-modules", "sql=/adapters/sql"],
     ["LoRA adapter 'sql' (/adapters/sql)", "adapter_config.json"]),
    (["--limit-mm-per-prompt", '{"image": 2}'], ["--limit-mm-per-prompt", "multimodal inputs are not supported"]),
    (["--runner", "draft"], ["--runner draft", "--speculative-config"]),
])
def test_unsupported_vllm_features_stop_start_up_naming_the_flag(start_server, flags, words):  # noqa: F811
    server = start_server(*flags)
    assert server.wait_exit(60) == 2
    for word in words:
        assert word in server.log()


def test_request_id_header_is_echoed_or_made(server):
    given = httpx.get(server.url + "/v1/models", headers={"X-Request-Id": "trace-42"}, timeout=30)
    assert given.headers["x-request-id"] == "trace-42"
    made = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=30)
    assert len(made.headers["x-request-id"]) == 32


def test_root_path_serves_with_and_without_the_prefix(server):
    for path in ("/llm/v1/models", "/v1/models"):
        assert httpx.get(server.url + path, timeout=30).json()["data"][0]["id"] == MODEL


def test_load_counts_generation_requests_in_flight(server):
    assert httpx.get(server.url + "/load", timeout=30).json() == {"server_load": 0}
    body = {"prompt": "a", "max_tokens": 2000, "ignore_eos": True, "stream": True}  # seconds of work
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as running:
        lines = running.iter_lines()  # kept: a dropped line iterator closes the stream (a disconnect)
        next(lines)
        assert httpx.get(server.url + "/load", timeout=30).json() == {"server_load": 1}
    wait_for_load(server, 0)  # the disconnect aborted it


def wait_for_load(server, expected: int) -> None:
    deadline = time.monotonic() + 60
    while httpx.get(server.url + "/load", timeout=30).json()["server_load"] != expected:
        assert time.monotonic() < deadline, f"/load never returned {expected}"
        time.sleep(0.1)


def test_tokenizer_info_names_the_template_not_a_folder(server, server_model):  # noqa: F811
    response = httpx.get(server.url + "/tokenizer_info", timeout=30)
    info = response.json()
    assert info["tokenizer_class"] and "add_generation_prompt" in info["chat_template"]
    assert info["eos_token"] == "<|endoftext|>" and str(server_model) not in response.text


def test_prompt_tokens_details_count_prefix_cache_hits(client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details is None  # as vLLM: left out when nothing was cached
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens and cached % 16 == 0  # whole blocks of --block-size 16


@pytest.mark.parametrize("body, kind", [
    ({"messages": MESSAGES, "max_tokens": 2}, "chat.completion"),
    ({"prompt": "The quick", "max_tokens": 2}, "text_completion"),
])
def test_invocations_route_by_body_shape(server, body, kind):
    assert httpx.post(server.url + "/invocations", json=body, timeout=60).json()["object"] == kind


def test_invocations_refuse_a_body_of_neither_shape(server):
    error = httpx.post(server.url + "/invocations", json={"input": "x"}, timeout=60).json()["error"]
    assert error["code"] == 400 and "messages" in error["message"]
    error = httpx.post(server.url + "/invocations", json={"prompt": "x", "n": "2"}, timeout=60).json()["error"]
    assert error["code"] == 400 and error["param"] == "n"


def test_unix_socket(start_server, tmp_path):  # noqa: F811
    socket_path = str(tmp_path / "tengyun.sock")
    server = start_server("--uds", socket_path)
    with httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), base_url="http://localhost") as http:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                if http.get("/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        answer = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60)
    assert answer.json()["usage"]["completion_tokens"] == 2, server.log()


def test_tokens_as_token_ids_from_the_flag_unless_the_request_says_no(client):
    kw = dict(model=MODEL, prompt="The quick", max_tokens=3, logprobs=2, temperature=0)
    as_ids = client.completions.create(**kw).choices[0]
    as_text = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": False}).choices[0]
    ids = [int(t.removeprefix("token_id:")) for t in as_ids.logprobs.tokens]
    assert len(ids) == 3 and all(t.startswith("token_id:") for t in as_ids.logprobs.tokens)
    assert all(key.startswith("token_id:") for top in as_ids.logprobs.top_logprobs for key in top)
    assert "".join(as_text.logprobs.tokens) == as_text.text == as_ids.text
    assert as_ids.logprobs.text_offset == as_text.logprobs.text_offset  # offsets still count text

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert all(c.token.startswith("token_id:") and c.bytes == list(c.token.encode()) for c in content)
    assert all(top.token.startswith("token_id:") for c in content for top in c.top_logprobs)


# ----- vLLM's request fields -----------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("length_penalty", 0.5), ("early_stopping", True), ("priority", 1), ("allowed_token_ids", [1, 2]),
    ("bad_words", ["fox"]), ("cache_salt", "tenant-a"), ("logits_processors", ["x"]),
    ("guided_whitespace_pattern", " "), ("kv_transfer_params", {}), ("vllm_xargs", {"a": 1}),
    ("guided_decoding_backend", "outlines"), ("seed", 2 ** 64), ("truncate_prompt_tokens", 0),
])
def test_fields_this_server_does_not_do_are_400_naming_them(server, field, value):
    for path, body in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        error = httpx.post(server.url + path, json={**body, "max_tokens": 1, field: value}, timeout=60).json()["error"]
        assert error["code"] == 400 and error["param"] == field, error


def test_their_defaults_and_xgrammar_are_accepted(client):
    extra = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0, "guided_decoding_backend": "xgrammar"}
    assert client.completions.create(model=MODEL, prompt="a", max_tokens=1, extra_body=extra).choices


def test_unknown_fields_are_ignored_with_a_log_line(server, client):
    client.completions.create(model=MODEL, prompt="a", max_tokens=1, extra_body={"frobnicate": 1})
    assert "CompletionRequest: ignored the unknown field(s) 'frobnicate'" in server.log()


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, client):
    prompt = list(range(10, 110))  # 100 token ids
    kept = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=0,
                                     extra_body={"truncate_prompt_tokens": 10, "return_token_ids": True})
    assert kept.usage.prompt_tokens == 10 and kept.choices[0].prompt_token_ids == prompt[-10:]
    too_many = {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 4096}
    error = httpx.post(server.url + "/v1/completions", json=too_many, timeout=60).json()["error"]
    assert error["param"] == "truncate_prompt_tokens" and "--max-model-len" in error["message"]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3


def test_return_token_ids_whole_and_streamed(server, client):
    kw = dict(model=MODEL, max_tokens=5, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    full = client.completions.create(prompt="The quick brown", **kw).choices[0]
    tokenized = httpx.post(server.url + "/tokenize", json={"prompt": "The quick brown"}, timeout=60).json()
    assert full.prompt_token_ids == tokenized["tokens"] and len(full.token_ids) == 5
    chunks = list(client.completions.create(prompt="The quick brown", stream=True, **kw))
    assert sum((c.choices[0].token_ids for c in chunks), []) == full.token_ids
    assert chunks[0].choices[0].prompt_token_ids == full.prompt_token_ids

    chat = client.chat.completions.create(messages=MESSAGES, **kw)
    rendered = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}, timeout=60).json()
    assert chat.prompt_token_ids == rendered["tokens"] and len(chat.choices[0].token_ids) == 5
    streamed = list(client.chat.completions.create(messages=MESSAGES, stream=True, **kw))
    assert streamed[0].prompt_token_ids == rendered["tokens"]
    assert sum((c.choices[0].token_ids or [] for c in streamed if c.choices), []) == chat.choices[0].token_ids


def test_chat_echo_starts_the_answer_with_the_continued_message(client):
    messages = [*MESSAGES, {"role": "assistant", "content": "It jumps"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=4, temperature=0,
              extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True})
    plain_kw = {**kw, "extra_body": {**kw["extra_body"], "echo": False}}
    plain = client.chat.completions.create(**plain_kw).choices[0].message.content
    echoed = client.chat.completions.create(**kw).choices[0].message.content
    assert echoed == "It jumps" + plain
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw))
    assert streamed == echoed


def test_request_id_names_the_answer(client):
    answer = client.completions.create(model=MODEL, prompt="a", max_tokens=1, extra_body={"request_id": "job-7"})
    assert answer.id == "cmpl-job-7"


def test_top_logprobs_in_vllms_order_sampled_token_first():
    """vLLM 0.11 lists a step's logprobs with the sampled token first, then by rank: chat's k
    top_logprobs are the first k of that list, completions' the sampled token plus the top k."""
    from tengyun.entrypoints.openai.serving_chat import chat_logprobs
    from tengyun.entrypoints.openai.serving_completion import completion_logprobs
    from tengyun.outputs import Logprob

    entry = {4: Logprob(-0.5, 1, "a"), 7: Logprob(-1.0, 2, "b"), 9: Logprob(-2.0, 3, "c")}  # 9 was sampled
    assert [t.token for t in chat_logprobs([9], [entry], 2).content[0].top_logprobs] == ["c", "a"]
    assert list(completion_logprobs([9], [entry], 2, 0).top_logprobs[0]) == ["c", "a", "b"]
    greedy = chat_logprobs([4], [entry], 2).content[0].top_logprobs
    assert [t.token for t in greedy] == ["a", "b"]


def test_sse_events_stay_one_line_for_any_line_splitter():
    """U+2028, U+2029 and U+0085 in generated text are JSON-escaped: clients that split lines as
    str.splitlines() does (httpx's iter_lines) still read whole events."""
    from tengyun.entrypoints.openai.serving_engine import sse

    event = sse({"text": "a\u2028b\x85c\u2029d 中文"})
    assert event.splitlines() == [event.removesuffix("\n\n"), ""]
    assert json.loads(event.removeprefix("data: "))["text"] == "a\u2028b\x85c\u2029d 中文"


@pytest.mark.parametrize("exclude", [None, {"usage"}])
def test_streamed_chunks_are_compact_json_of_the_response_on_one_line(exclude):
    """A stream chunk is pydantic's own compact JSON (as vLLM sends it): the fields model_dump
    gives, none excluded that was not asked, every line separator escaped."""
    from tengyun.entrypoints.openai.protocol import CompletionResponseChoice, CompletionStreamResponse, UsageInfo
    from tengyun.entrypoints.openai.serving_engine import sse_model

    text = "a\u2028b\x85c\u2029d 中文"
    chunk = CompletionStreamResponse(id="cmpl-1", created=1, model="m", usage=UsageInfo(prompt_tokens=3),
                                     choices=[CompletionResponseChoice(index=0, text=text, finish_reason="length")])
    event = sse_model(chunk, exclude)
    assert event.startswith('data: {"id":"cmpl-1","object":"text_completion",') and event.endswith("}\n\n")
    assert event.splitlines() == [event.removesuffix("\n\n"), ""]
    assert json.loads(event.removeprefix("data: ")) == chunk.model_dump(exclude=exclude)
