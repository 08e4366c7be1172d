"""--generation-config on the real server: the model's generation_config.json fills the sampling
fields a request leaves unset (chat and completions); a request's own values win; `vllm` drops it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest

from remote_server import API_KEY, MAX_MODEL_LEN, RemoteServer, running_server

MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
PROMPT = "The quick brown fox"
DEFAULTS = {"bos_token_id": 0, "eos_token_id": 0, "do_sample": True,
            "temperature": 0.0, "repetition_penalty": 3.0, "max_new_tokens": 5}


@pytest.fixture(scope="module")
def model_with_defaults(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    from conftest import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("gen_server_llama"), tiny_tokenizer_dir, "llama",
                                  max_position_embeddings=MAX_MODEL_LEN)
    (folder / "generation_config.json").write_text(json.dumps(DEFAULTS))
    return folder


@pytest.fixture(scope="module")
def auto_server(model_with_defaults, tmp_path_factory):
    yield from running_server(model_with_defaults, ["--api-key", API_KEY],
                              tmp_path_factory.mktemp("gen_auto") / "server.log")


@pytest.fixture(scope="module")
def vllm_server(model_with_defaults, tmp_path_factory):
    yield from running_server(model_with_defaults, ["--api-key", API_KEY, "--generation-config", "vllm"],
                              tmp_path_factory.mktemp("gen_vllm") / "server.log")


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat(server, extra: dict | None = None, **fields):
    """extra: vLLM's fields beyond OpenAI's, such as repetition_penalty."""
    return client(server).chat.completions.create(model=None, messages=MESSAGES,
                                                  extra_body={"ignore_eos": True, **(extra or {})}, **fields)


def complete(server, extra: dict | None = None, **fields):
    return client(server).completions.create(model=None, prompt=PROMPT,
                                             extra_body={"ignore_eos": True, **(extra or {})}, **fields)


def test_start_up_logs_the_models_defaults_once(auto_server, vllm_server):
    log = auto_server.log()
    assert log.count("overridden by the model's generation config") == 1
    assert "repetition_penalty=3.0, temperature=0.0, max_tokens=5" in log
    assert "overridden by the model's generation config" not in vllm_server.log()


def test_unset_max_tokens_takes_max_new_tokens_and_an_explicit_one_wins(auto_server):
    answer = chat(auto_server)
    assert (answer.usage.completion_tokens, answer.choices[0].finish_reason) == (5, "length")
    assert chat(auto_server, max_tokens=7).usage.completion_tokens == 7
    assert chat(auto_server, max_completion_tokens=8).usage.completion_tokens == 8
    assert complete(auto_server).usage.completion_tokens == 5  # not the schema's 16
    assert complete(auto_server, max_tokens=9).usage.completion_tokens == 9


def test_unset_sampling_fields_take_the_models_defaults_and_explicit_ones_win(auto_server):
    defaulted = chat(auto_server, max_tokens=16).choices[0].message.content
    explicit = chat(auto_server, max_tokens=16, temperature=0.0,
                    extra={"repetition_penalty": 3.0}).choices[0].message.content
    unpenalized = chat(auto_server, max_tokens=16, temperature=0.0,
                       extra={"repetition_penalty": 1.0}).choices[0].message.content
    assert defaulted == explicit
    assert defaulted != unpenalized  # the default penalty changed the greedy tokens
    # temperature 0 by default: greedy, so seeds do not matter
    assert {complete(auto_server, max_tokens=16, seed=seed).choices[0].text for seed in (1, 2, 3)} == \
        {complete(auto_server, max_tokens=16, temperature=0.0,
                  extra={"repetition_penalty": 3.0}).choices[0].text}


def test_generation_config_vllm_keeps_the_engines_defaults(vllm_server):
    assert complete(vllm_server).usage.completion_tokens == 16
    greedy = complete(vllm_server, max_tokens=16, temperature=0.0).choices[0].text
    assert greedy == complete(vllm_server, max_tokens=16, temperature=0.0,
                              extra={"repetition_penalty": 1.0}).choices[0].text
    assert greedy != complete(vllm_server, max_tokens=16, temperature=0.0,
                              extra={"repetition_penalty": 3.0}).choices[0].text
    # temperature 1: different seeds sample different tokens
    assert len({complete(vllm_server, max_tokens=16, seed=seed).choices[0].text for seed in (1, 2, 3)}) > 1


def test_bad_generation_config_path_exits_2_naming_the_flag_and_path(model_with_defaults, tmp_path):
    missing = tmp_path / "no_such_folder"
    server = RemoteServer(model_with_defaults, ["--generation-config", str(missing)], tmp_path / "server.log")
    try:
        assert server.wait_exit() == 2
        assert f"--generation-config '{missing}'" in server.log() and "Traceback" not in server.log()
    finally:
        server.stop()


def test_default_max_tokens_is_cut_to_the_room_the_prompt_leaves():
    from tengyun.entrypoints.openai.serving_engine import OpenAIServing

    engine = SimpleNamespace(config=SimpleNamespace(max_model_len=10, model_spec=SimpleNamespace(vocab_size=100),
                                                    max_logprobs=20))
    serving = OpenAIServing(engine, None, "m", sampling_defaults={"max_tokens": 5})
    assert [serving.default_max_tokens(n, 16) for n in (3, 8, 10)] == [5, 2, None]
    assert OpenAIServing(engine, None, "m").default_max_tokens(8, 16) == 16
