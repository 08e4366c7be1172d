"""The real server with LoRA adapters, through the openai SDK: an adapter picked by its name in
"model" answers as PEFT's model does, /v1/models lists it with its parent, an adapter is loaded
and unloaded at run time while another request streams, unknown names are vLLM's 404s, and
vllm:lora_requests_info names the adapters."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch

from peft_adapters import make_peft_adapter

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints" / "openai"))
from remote_server import running_server, server_model  # noqa: E402, F401 (fixtures)

MODEL = "tiny-llama"
PROMPT = "The quick brown fox"
MAX_TOKENS = 6


def _peft_greedy(model, tokenizer) -> list[int]:
    ids = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            ids = ids + [int(model(torch.tensor([ids])).logits[0, -1].argmax())]
    return ids[-MAX_TOKENS:]


@pytest.fixture(scope="module")
def adapters(server_model, tmp_path_factory):  # noqa: F811
    """{name: (folder, PEFT's greedy tokens)} for "sql" (served from start-up) and "chat" (loaded later)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server_model)
    made = {}
    for seed, name in enumerate(("sql", "chat")):
        folder = tmp_path_factory.mktemp(f"lora_{name}")
        model = make_peft_adapter(server_model, folder, seed=seed, r=4 + 4 * seed)
        made[name] = (folder, _peft_greedy(model, tokenizer))
    return made


@pytest.fixture(scope="module")
def server(server_model, adapters, tmp_path_factory):  # noqa: F811
    args = ["--served-model-name", MODEL, "--dtype", "float32", "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", "8", "--lora-modules", f"sql={adapters['sql'][0]}"]
    log = tmp_path_factory.mktemp("lora_server") / "server.log"
    yield from running_server(server_model, args, log, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _greedy(client: openai.OpenAI, model: str) -> list[int]:
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    assert response.model == model
    return response.choices[0].token_ids


def test_the_model_field_picks_the_adapter_and_it_answers_as_peft(server, adapters):
    client = _client(server)
    assert _greedy(client, "sql") == adapters["sql"][1]
    assert _greedy(client, MODEL) != adapters["sql"][1]  # the base model answers without it
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "sql" and chat.choices[0].finish_reason in ("length", "stop")


def test_models_lists_the_adapter_with_its_parent(server, adapters):
    cards = {card.id: card for card in _client(server).models.list().data}
    assert set(cards) == {MODEL, "sql"}
    assert cards["sql"].parent == MODEL and cards["sql"].root == str(adapters["sql"][0])


def test_an_unknown_model_is_a_404_as_vllm_answers(server):
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist; this server serves `tiny-llama` "
                                                   "and the LoRA adapters `sql`."):
        _client(server).completions.create(model="nope", prompt=PROMPT, max_tokens=1)


def test_load_and_unload_at_run_time_while_another_request_streams(server, adapters):
    client = _client(server)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    received, finish = 0, None
    for i, chunk in enumerate(stream):
        received += len(chunk.choices[0].text) > 0 or 0
        finish = chunk.choices[0].finish_reason or finish
        if i == 2:  # mid-stream: load "chat", use it, unload it
            load = httpx.post(server.url + "/v1/load_lora_adapter",
                              json={"lora_name": "chat", "lora_path": str(adapters["chat"][0])}, timeout=60)
            assert load.status_code == 200 and load.text == "Success: LoRA adapter 'chat' added successfully."
            assert {card.id for card in client.models.list().data} == {MODEL, "sql", "chat"}
            assert _greedy(client, "chat") == adapters["chat"][1]
            again = httpx.post(server.url + "/v1/load_lora_adapter",
                               json={"lora_name": "chat", "lora_path": str(adapters["chat"][0])}, timeout=60)
            assert again.status_code == 400 and "has already been loaded" in again.text
            unload = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=60)
            assert unload.status_code == 200 and unload.text == "Success: LoRA adapter 'chat' removed successfully."
            assert {card.id for card in client.models.list().data} == {MODEL, "sql"}
            with pytest.raises(openai.NotFoundError, match="The model `chat` does not exist;"):
                client.completions.create(model="chat", prompt=PROMPT, max_tokens=1)
    assert finish == "length"  # the streaming request lost nothing
    gone = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=60)
    assert gone.status_code == 404 and "The lora adapter 'chat' cannot be found." in gone.text


def test_no_adapter_at_the_path_is_vllms_404_and_a_bad_adapter_a_400_naming_it(server, tmp_path):
    load = server.url + "/v1/load_lora_adapter"
    missing = httpx.post(load, json={"lora_name": "x", "lora_path": str(tmp_path)}, timeout=60)
    assert missing.status_code == 404
    assert f"Loading lora x failed: No adapter found for {tmp_path}" in missing.json()["error"]["message"]
    (tmp_path / "adapter_config.json").write_text('{"r": 4, "use_dora": true}')
    bad = httpx.post(load, json={"lora_name": "x", "lora_path": str(tmp_path)}, timeout=60)
    assert bad.status_code == 400 and "LoRA adapter 'x'" in bad.json()["error"]["message"]
    assert "does not yet support DoRA" in bad.json()["error"]["message"]


def test_lora_requests_info_names_the_adapters(server):
    _greedy(_client(server), "sql")
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    for prefix in ("vllm:", "tengyun:"):
        line = next(line for line in metrics.splitlines() if line.startswith(prefix + "lora_requests_info{"))
        assert 'max_lora="2"' in line
