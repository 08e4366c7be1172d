"""logit_bias and --max-logprobs through the server (official openai SDK, real server on loopback,
started with --max-logprobs 30), with vLLM's semantics: a bias is clamped to [-100, 100], a key
that is no token id of the vocabulary is a 400; a logprob count above --max-logprobs is a 400
naming the field and the flag; -1 (the whole vocabulary) only where --max-logprobs allows it.
Token ids come from the offline LLM on the same checkpoint (full-vocabulary logprobs).

Both sides run without prefix caching: a prompt another test sent first would otherwise prefill only its
uncached tail on the server (the paged kernel) while the offline LLM prefills it whole (SDPA on a CPU with
AMX, bfloat16), and the two sums round one bfloat16 step apart in the logits."""

from __future__ import annotations

import httpx
import openai
import pytest

from remote_server import API_KEY, MAX_MODEL_LEN, running_server, server_model  # noqa: F401 (fixture)
from tengyun import LLM, SamplingParams
from tengyun.entrypoints.openai.serving_chat import chat_logprobs
from tengyun.outputs import Logprob

MODEL = "tiny-llama"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
STEPS = 6
GREEDY = dict(model=MODEL, temperature=0, max_tokens=STEPS, extra_body={"ignore_eos": True})
TOKEN = 42  # an ordinary token of the tiny vocabulary (300 tokenizer ids, 384 model ids)


@pytest.fixture(scope="module")
def server(server_model, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("logit_bias_server") / "server.log"
    yield from running_server(server_model, ["--api-key", API_KEY, "--served-model-name", MODEL,
                                             "--max-logprobs", "30", "--no-enable-prefix-caching"], log)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(server_model):  # noqa: F811
    return LLM(str(server_model), max_model_len=MAX_MODEL_LEN, kv_cache_memory="64MiB", max_logprobs=-1,
               enable_prefix_caching=False)


def _offline(llm, **params):
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **params)
    return llm.generate(PROMPT, params)[0].outputs[0]


def _by_rank(entry: dict[int, Logprob]) -> list[int]:
    return [t for t, _ in sorted(entry.items(), key=lambda item: item[1].rank)]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"})


def test_plus_100_makes_the_token_every_token(client, llm):
    tokenizer = llm.get_tokenizer()
    r = client.completions.create(prompt=PROMPT, logprobs=0, logit_bias={str(TOKEN): 100}, **GREEDY)
    assert r.choices[0].logprobs.tokens == [tokenizer.decode([TOKEN])] * STEPS
    assert r.choices[0].text == tokenizer.decode([TOKEN] * STEPS)
    assert _offline(llm, logit_bias={TOKEN: 100}).token_ids == [TOKEN] * STEPS
    chat = client.chat.completions.create(messages=MESSAGES, logit_bias={str(TOKEN): 100}, **GREEDY)
    assert chat.choices[0].message.content == tokenizer.decode([TOKEN] * STEPS)


def test_a_streamed_completion_sends_a_chunk_for_every_token_while_text_is_held_back(client, llm):
    """vLLM's completions stream sends a chunk for every step that made a token, with empty text while
    the text is held back (here: each token's text could begin the stop string until the next one
    comes), so a client counting chunks counts tokens, and its first token's time is when the token
    came, not when its text did. Chat leaves such steps out, as vLLM does."""
    text = llm.get_tokenizer().decode([TOKEN])
    assert text and "~" not in text
    forced = dict(logit_bias={str(TOKEN): 100}, stop=[text + "~"], **GREEDY)
    kw = dict(prompt=PROMPT, **forced)
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert [c.text for c in chunks] == [""] + [text] * (STEPS - 2) + [text * 2]
    assert [c.finish_reason for c in chunks] == [None] * (STEPS - 1) + ["length"]
    assert "".join(c.text for c in chunks) == client.completions.create(**kw).choices[0].text == text * STEPS
    deltas = [(c.choices[0].delta.content, c.choices[0].finish_reason) for c in client.chat.completions.create(
        messages=MESSAGES, stream=True, **forced) if c.choices]
    assert deltas == [("", None)] + [(text, None)] * (STEPS - 2) + [(text * 2, "length")]


def test_minus_100_on_the_greedy_token_takes_the_runner_up(client, llm):
    unbiased = _offline(llm, logprobs=-1)
    first = unbiased.token_ids[0]
    runner_up = _by_rank(unbiased.logprobs[0])[1]  # the raw logprobs' second most likely at step 0
    biased = _offline(llm, logit_bias={first: -100})
    assert biased.token_ids[0] == runner_up and first not in biased.token_ids
    plain = client.completions.create(prompt=PROMPT, **GREEDY)
    assert plain.choices[0].text == unbiased.text
    r = client.completions.create(prompt=PROMPT, logit_bias={str(first): -100}, **GREEDY)
    assert r.choices[0].text == biased.text != unbiased.text


def test_biases_beyond_100_are_clamped_as_vllm_does(client, llm):
    # Step 0's two most likely tokens, best > second. Unclamped, +150 on the second beats +100 on
    # the best; clamped, both get +100 and the best stays first.
    best, second = _by_rank(_offline(llm, logprobs=-1).logprobs[0])[:2]
    bias = {second: 150, best: 100}
    assert _offline(llm, logit_bias=bias).token_ids[0] == second  # the engine itself does not clamp
    r = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=0, max_tokens=1, temperature=0,
                                  logit_bias={str(t): b for t, b in bias.items()})
    assert r.choices[0].logprobs.tokens == [llm.get_tokenizer().decode([best])]


@pytest.mark.parametrize("path, body, words", [
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"fox": 5}}, ["logit_bias", "'fox'"]),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"384": 5}}, ["logit_bias", "[384]", "384)"]),
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"-1": 5}}, ["logit_bias", "[-1]"]),
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"5": "high"}}, ["logit_bias"]),
])
def test_bad_logit_bias_is_400_naming_it(server, path, body, words):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "logit_bias"
    for word in words:
        assert word in error["message"]


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 31}, "logprobs", ["31", "--max-logprobs is 30"]),
    ("/v1/completions", {"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 31}, "logprobs",
     ["--max-logprobs"]),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": -1}, "prompt_logprobs",
     ["whole vocabulary of 384", "--max-logprobs is 30"]),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 31}, "top_logprobs",
     ["--max-logprobs is 30"]),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}, "top_logprobs",
     ["whole vocabulary", "--max-logprobs"]),
])
def test_logprobs_above_max_logprobs_is_400_naming_the_field_and_flag(server, path, body, param, words):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    for word in words:
        assert word in error["message"]


def test_completions_logprobs_minus_one_is_400_as_in_vllm(server):
    # vLLM takes -1 for chat's top_logprobs and prompt_logprobs, not for completions' logprobs.
    r = post(server, "/v1/completions", {"prompt": PROMPT, "logprobs": -1})
    assert r.status_code == 400 and "logprobs must be >= 0" in r.json()["error"]["message"]


def test_25_logprobs_pass_under_max_logprobs_30(client, llm):
    offline = _offline(llm, logprobs=-1)
    top25 = [sorted((lp.logprob for lp in entry.values()), reverse=True)[:25] for entry in offline.logprobs]
    chat_offline = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True,
                                                     logprobs=-1))[0].outputs[0]
    chat = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=25, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == STEPS
    for got, entry in zip(content, chat_offline.logprobs):
        want = sorted((lp.logprob for lp in entry.values()), reverse=True)[:25]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(want, abs=1e-4)
    r = client.completions.create(prompt=PROMPT, logprobs=25, **GREEDY)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == offline.text
    for top, want, value in zip(lp.top_logprobs, top25, lp.token_logprobs):
        # Keyed by string: tokens that decode alike share a key (the most likely one's value).
        assert 0 < len(top) <= 26
        assert all(any(v == pytest.approx(w, abs=1e-4) for w in want + [value]) for v in top.values())


def test_chat_top_logprobs_minus_one_lists_every_token_by_rank():
    entry = {7: Logprob(-0.1, 1, "a"), 3: Logprob(-2.0, 3, "c"), 5: Logprob(-1.5, 2, "b")}
    content = chat_logprobs([7], [entry], -1).content[0]
    assert [t.token for t in content.top_logprobs] == ["a", "b", "c"]
    assert [t.token for t in chat_logprobs([7], [entry], 2).content[0].top_logprobs] == ["a", "b"]
