"""use_beam_search on /v1/completions and /v1/chat/completions through the official openai SDK,
against a real server subprocess (tiny random Llama) and HF transformers' generate(num_beams)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from remote_server import running_server, server_model  # noqa: F401 (fixtures)

MODEL = "beams"
PROMPTS = [[5, 17, 29, 41, 7, 90, 12, 33, 61, 250, 8], [100, 101, 102, 103, 104, 105]]
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def server(server_model, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("beams") / "server.log"
    yield from running_server(server_model, ["--served-model-name", MODEL], log)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def hf_beam_tokens(model_dir, prompt: list[int], width: int, max_tokens: int) -> list[list[int]]:
    """HF's beams, best first, EOS off (the server's ignore_eos)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                             do_sample=False, max_new_tokens=max_tokens, early_stopping="never", eos_token_id=None,
                             pad_token_id=0)
    return [seq[len(prompt):].tolist() for seq in out]


def test_completions_answer_n_beams_per_prompt_best_first_as_hf(client, server_model):  # noqa: F811
    kw = dict(model=MODEL, prompt=PROMPTS, n=2, max_tokens=6, temperature=0.0, logprobs=2,
              extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True})
    answer = client.completions.create(**kw)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]  # prompt i's beams at i * n, i * n + 1
    expected = [tokens for prompt in PROMPTS for tokens in hf_beam_tokens(server_model, prompt, 2, 6)]
    assert [c.token_ids for c in answer.choices] == expected
    assert all(c.finish_reason == "length" for c in answer.choices)
    for c in answer.choices:  # each token's logprob and the top 2 of the candidates its step offered
        assert len(c.logprobs.token_logprobs) == 6 and all(lp <= 0 for lp in c.logprobs.token_logprobs)
        assert all(1 <= len(top) <= 3 for top in c.logprobs.top_logprobs)  # one key per text: "\ufffd" pieces merge
    assert answer.usage.completion_tokens == 4 * 6 and answer.usage.prompt_tokens == 11 + 6
    # stream: vLLM sends the whole answer as one event
    chunks = list(client.completions.create(stream=True, **kw))
    assert len(chunks) == 1 and [c.text for c in chunks[0].choices] == [c.text for c in answer.choices]


def test_chat_beams_and_their_stream(client):
    kw = dict(model=MODEL, messages=MESSAGES, n=3, max_tokens=8, temperature=0.0,
              extra_body={"use_beam_search": True, "length_penalty": 0.5})
    answer = client.chat.completions.create(**kw)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in answer.choices)
    texts = {0: "", 1: "", 2: ""}
    finish = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert texts == {c.index: c.message.content for c in answer.choices}
    assert finish == {c.index: c.finish_reason for c in answer.choices}


def test_early_stopping_true_answers_finished_beams_only(client):
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=2, max_tokens=60, temperature=0.0,
                                       extra_body={"use_beam_search": True, "early_stopping": True,
                                                   "length_penalty": 0.0})
    assert [c.finish_reason for c in answer.choices] == ["stop", "stop"]


@pytest.mark.parametrize("field, extra, message", [
    ("n", {"n": 11}, "beam width: n 11 ranks 22 candidate tokens per beam each step but --max-logprobs is 20"),
    ("top_p", {"n": 2, "top_p": 0.5}, "top_p is not applied by beam search"),
    ("stop", {"n": 2, "stop": ["fox"]}, "stop is not applied by beam search"),
    ("early_stopping", {"early_stopping": "sometimes"}, None),
    ("length_penalty", {"length_penalty": 0.5, "use_beam_search": False}, "applies to beam search only"),
])
def test_bad_beam_search_requests_are_400_naming_the_field(server, field, extra, message):
    for path, body in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        response = httpx.post(server.url + path, json={"use_beam_search": True, **body, "max_tokens": 2, **extra},
                              timeout=60)
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == field, error
        assert message is None or message in error["message"], error
