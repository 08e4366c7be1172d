"""prompt_embeds on /v1/completions (--enable-prompt-embeds) and --skip-tokenizer-init, through the
official openai SDK against real servers over a tiny random Llama: embeddings answer as their
token ids do and as HF transformers does, alone, several at once, mixed with text and streamed;
bad input is a 400 naming the field or the flag; without a tokenizer, ids in and ids out."""

from __future__ import annotations

import base64
import io
import shutil

import openai
import pytest
import torch

from remote_server import running_server, server_model  # noqa: F401 (fixture)

IDS = [5, 17, 33, 99, 120, 7, 8, 250, 3, 44, 61]
MAX_TOKENS = 6


def _b64(tensor: torch.Tensor) -> str:
    """What vLLM's docs tell a client to send: base64 of torch.save(tensor)."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def hf_model(server_model):  # noqa: F811
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(server_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_greedy(hf_model):
    """HF transformers' greedy continuation of IDS, from generate(inputs_embeds=...)."""
    embeds = hf_model.get_input_embeddings()(torch.tensor(IDS)).detach()
    with torch.no_grad():
        out = hf_model.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, len(IDS), dtype=torch.long),
                                max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, -MAX_TOKENS:].tolist()


@pytest.fixture(scope="module")
def embeds_client(server_model, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("embeds") / "server.log"
    for server in running_server(server_model, ["--dtype", "float32", "--enable-prompt-embeds",
                                                "--max-num-batched-tokens", "8"], log):  # chunked prompts
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none")


@pytest.fixture(scope="module")
def ids_only_client(server_model, tmp_path_factory):  # noqa: F811
    """--skip-tokenizer-init over a copy of the checkpoint without its tokenizer files."""
    folder = tmp_path_factory.mktemp("no_tokenizer") / "model"
    shutil.copytree(server_model, folder, ignore=shutil.ignore_patterns("*token*", "vocab*", "merges*"))
    log = folder.parent / "server.log"
    for server in running_server(folder, ["--dtype", "float32", "--skip-tokenizer-init"], log):
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def _complete(client, **body):
    extra = {key: body.pop(key) for key in ("prompt_embeds", "return_token_ids", "prompt_logprobs") if key in body}
    body.setdefault("prompt", "")  # the SDK requires the field; "" beside prompt_embeds means none (as vLLM)
    return client.completions.create(model=None, max_tokens=MAX_TOKENS, temperature=0.0, extra_body=extra,
                                     **body)


def test_embeds_answer_as_token_ids_and_hf(embeds_client, hf_model, hf_greedy):
    embeds = hf_model.get_input_embeddings()(torch.tensor(IDS)).detach()
    from_embeds = _complete(embeds_client, prompt="", prompt_embeds=_b64(embeds), return_token_ids=True, logprobs=1)
    from_ids = _complete(embeds_client, prompt=IDS, return_token_ids=True)
    choice = from_embeds.choices[0]
    assert choice.token_ids == from_ids.choices[0].token_ids == hf_greedy
    assert choice.text == from_ids.choices[0].text
    assert from_embeds.usage.prompt_tokens == len(IDS)  # one per row
    assert len(choice.logprobs.token_logprobs) == MAX_TOKENS
    # bfloat16 rows are read and cast, as vLLM does
    bf16 = _complete(embeds_client, prompt_embeds=_b64(embeds.bfloat16()), return_token_ids=True)
    assert len(bf16.choices[0].token_ids) == MAX_TOKENS


def test_several_embeds_with_a_prompt_come_first_and_stream_the_same(embeds_client, hf_model):
    table = hf_model.get_input_embeddings()
    first, second = (_b64(table(torch.tensor(ids)).detach()) for ids in (IDS, IDS[3:]))
    text_only = _complete(embeds_client, prompt="The quick brown fox").choices[0].text
    second_only = _complete(embeds_client, prompt_embeds=second).choices[0].text
    mixed = _complete(embeds_client, prompt="The quick brown fox", prompt_embeds=[first, second])
    assert [c.index for c in mixed.choices] == [0, 1, 2]
    assert [c.text for c in mixed.choices[1:]] == [second_only, text_only]
    stream = embeds_client.completions.create(model=None, prompt="", max_tokens=MAX_TOKENS, temperature=0.0,
                                              stream=True, extra_body={"prompt_embeds": [first, second]})
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in mixed.choices[:2]]


@pytest.mark.parametrize("body, param, words", [
    (dict(prompt_embeds="invalid_base64"), "prompt_embeds", "not valid base64"),
    (dict(prompt_embeds=_b64(torch.zeros(3, 32))), "prompt_embeds", "hidden size 32 but the model's is 64"),
    (dict(prompt_embeds=_b64(torch.zeros(3, 64, dtype=torch.int32))), "prompt_embeds", "float32, bfloat16"),
    (dict(prompt_embeds=_b64(torch.zeros(3000, 64))), "max_tokens", "maximum context length"),
    (dict(prompt_embeds=_b64(torch.zeros(3, 64)), echo=True), "echo", "Echo is unsupported with prompt embeds"),
    (dict(prompt_embeds=_b64(torch.zeros(3, 64)), prompt_logprobs=1), "prompt_logprobs", "not compatible"),
    (dict(prompt=None), None, "Either prompt or prompt_embeds must be provided"),
])
def test_bad_embeds_are_a_400_naming_the_field(embeds_client, body, param, words):
    with pytest.raises(openai.BadRequestError) as error:
        _complete(embeds_client, **body)
    assert words in error.value.body["message"]
    if param is not None:
        assert error.value.body["param"] == param


def test_skip_tokenizer_init_takes_ids_and_answers_ids(ids_only_client, hf_greedy):
    """Token ids in, token ids out, empty text (as vLLM); logprob tokens are "token_id:N"."""
    answer = _complete(ids_only_client, prompt=IDS, echo=True, logprobs=1, return_token_ids=True)
    choice = answer.choices[0]
    assert choice.token_ids == hf_greedy  # same weights, same greedy tokens, no tokenizer anywhere
    assert choice.prompt_token_ids == IDS
    assert choice.text == ""
    assert choice.logprobs.tokens[-MAX_TOKENS:] == [f"token_id:{t}" for t in hf_greedy]


@pytest.mark.parametrize("call, words", [
    (lambda c: _complete(c, prompt="Hello"), "--skip-tokenizer-init"),
    (lambda c: c.chat.completions.create(model=None, messages=[{"role": "user", "content": "hi"}]),
     "--skip-tokenizer-init"),
    (lambda c: _complete(c, prompt=IDS, stop=["."]), "stop strings are only supported when detokenize is True"),
    (lambda c: _complete(c, prompt_embeds=_b64(torch.zeros(3, 64))), "You must set `--enable-prompt-embeds`"),
])
def test_without_tokenizer_or_flag_text_and_embeds_are_refused(ids_only_client, call, words):
    with pytest.raises(openai.BadRequestError) as error:
        call(ids_only_client)
    assert words in error.value.body["message"]
