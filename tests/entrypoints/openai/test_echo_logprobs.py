"""Prompt logprobs through the server (official openai SDK, real server on loopback): echo with
logprobs, echo with max_tokens 0 (scoring only), vLLM's prompt_logprobs field on completions
and chat; every number equals the offline LLM's on the same checkpoint."""

from __future__ import annotations

import httpx
import openai
import pytest

from remote_server import API_KEY, MAX_MODEL_LEN, running_server, server_model  # noqa: F401 (fixture)
from tengyun import LLM, SamplingParams

MODEL = "tiny-llama"
PROMPT = "Paris is the capital of France. Berlin is the capital of Germany. The quick brown fox jumps over"
MESSAGES = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
K = 3
BUDGET = 16  # --max-num-batched-tokens: the prompt is prefilled in chunks


@pytest.fixture(scope="module")
def server(server_model, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("echo_logprobs_server") / "server.log"
    yield from running_server(server_model, ["--api-key", API_KEY, "--served-model-name", MODEL,
                                             "--max-num-batched-tokens", str(BUDGET)], log)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(server_model):  # noqa: F811
    return LLM(str(server_model), max_model_len=MAX_MODEL_LEN, kv_cache_memory="64MiB",
               max_num_batched_tokens=BUDGET)


def _offline(llm, max_tokens=5):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    return llm.generate(PROMPT, params)[0]


def _legacy(token_ids, entries, tokenizer):
    """What OpenAI's legacy logprobs should hold: per token its string, logprob and top-K dict."""
    tokens, values, tops = [], [], []
    for token, entry in zip(token_ids, entries):
        if entry is None:
            tokens.append(tokenizer.decode([token]))
            values.append(None)
            tops.append(None)
            continue
        tokens.append(entry[token].decoded_token)
        values.append(entry[token].logprob)
        top = {}  # keyed by string: the first (most likely) of tokens that decode alike wins
        for t, lp in sorted(entry.items(), key=lambda item: item[1].rank):
            if t == token or lp.rank <= K:
                top.setdefault(lp.decoded_token, lp.logprob)
        tops.append(top)
    return tokens, values, tops


def _assert_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None or isinstance(w, str):
            assert g == w
        elif isinstance(w, dict):
            assert g.keys() == w.keys() and all(g[key] == pytest.approx(w[key], abs=1e-4) for key in w)
        else:
            assert g == pytest.approx(w, abs=1e-4)


def _assert_prompt_logprobs_json(got: list, want: list) -> None:
    """vLLM's `prompt_logprobs`: [null, {"token id": {"logprob", "rank", "decoded_token"}}, ...]."""
    assert got[0] is None and len(got) == len(want)
    for g, w in zip(got[1:], want[1:]):
        assert set(g) == {str(t) for t in w}
        for token, lp in w.items():
            item = g[str(token)]
            assert (item["rank"], item["decoded_token"]) == (lp.rank, lp.decoded_token)
            assert item["logprob"] == pytest.approx(lp.logprob, abs=1e-4)


def test_echo_with_logprobs_lists_the_prompt_then_the_completion(client, llm):
    offline = _offline(llm)
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=K, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    choice, completion = r.choices[0], offline.outputs[0]
    assert choice.text == PROMPT + completion.text
    tokens, values, tops = _legacy(offline.prompt_token_ids + completion.token_ids,
                                   offline.prompt_logprobs + completion.logprobs, llm.get_tokenizer())
    lp = choice.logprobs
    assert lp.tokens == tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    _assert_close(lp.token_logprobs, values)
    _assert_close(lp.top_logprobs, tops)
    num_prompt = len(offline.prompt_token_ids)
    assert lp.text_offset[:num_prompt] == [sum(len(t) for t in tokens[:i]) for i in range(num_prompt)]
    assert lp.text_offset[num_prompt] == len(PROMPT)  # the completion starts after the echoed prompt
    _assert_prompt_logprobs_json(choice.model_extra["prompt_logprobs"], offline.prompt_logprobs)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (num_prompt, 5)


def test_echo_with_max_tokens_0_scores_the_prompt_only(client, llm):
    offline = _offline(llm, max_tokens=1)
    r = client.completions.create(model=MODEL, prompt=[PROMPT, PROMPT], echo=True, logprobs=K, max_tokens=0,
                                  temperature=0)
    tokens, values, tops = _legacy(offline.prompt_token_ids, offline.prompt_logprobs, llm.get_tokenizer())
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        assert choice.text == PROMPT
        assert choice.logprobs.tokens == tokens
        _assert_close(choice.logprobs.token_logprobs, values)
        _assert_close(choice.logprobs.top_logprobs, tops)
        assert choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (2 * len(offline.prompt_token_ids), 0)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0)
    assert (echoed.choices[0].text, echoed.choices[0].logprobs) == (PROMPT, None)


def test_streamed_echo_logprobs_equal_the_full_answer(client):
    kw = dict(model=MODEL, prompt=PROMPT, echo=True, logprobs=K, max_tokens=6, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0]
    text, tokens, values, offsets = "", [], [], []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert text == full.text
    assert tokens == full.logprobs.tokens
    _assert_close(values, full.logprobs.token_logprobs)
    # Prompt offsets agree; completion offsets may not where a token decodes to U+FFFD alone (a
    # stream counts the characters it sent, the full answer the token strings), echo or not.
    num_prompt = len(tokens) - 6
    assert offsets[:num_prompt + 1] == full.logprobs.text_offset[:num_prompt + 1]


def test_prompt_logprobs_field_on_completions_and_chat(client, llm):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": K})
    assert r.choices[0].logprobs is None and r.choices[0].text == _offline(llm, 2).outputs[0].text
    _assert_prompt_logprobs_json(r.choices[0].model_extra["prompt_logprobs"], _offline(llm, 2).prompt_logprobs)

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 1})
    offline = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))[0]
    assert chat.choices[0].message.content == offline.outputs[0].text
    _assert_prompt_logprobs_json(chat.model_extra["prompt_logprobs"], offline.prompt_logprobs)
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1).model_extra.get(
        "prompt_logprobs") is None


@pytest.mark.parametrize("path, body, words", [
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, ["prompt_logprobs", "stream"]),
    ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 1, "stream": True}, ["prompt_logprobs"]),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}, ["prompt_logprobs", "20"]),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, ["max_tokens"]),  # 0 only with echo
])
def test_bad_prompt_logprobs_requests_are_400(server, path, body, words):
    r = httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    for word in words:
        assert word in r.json()["error"]["message"]
