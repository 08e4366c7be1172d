"""The server process loads its tokenizer beside the engine's load once the folder's tokenizer
class is recorded (engine_host._tokenizer), and answers as with one loaded afterwards."""

from __future__ import annotations

import httpx

from remote_server import server_model, start_server  # noqa: F401 (fixtures)

PRELOADED = "loaded beside the engine's load"


def _answer(server) -> str:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello, world", "max_tokens": 8,
                                                          "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_later_start_uses_the_tokenizer_loaded_beside_the_engines_load(start_server, tmp_path):  # noqa: F811
    env = {"TENGYUN_CACHE_DIR": str(tmp_path / "cache"), "VLLM_LOGGING_LEVEL": "DEBUG"}
    first = start_server(env=env).wait_ready()  # no record yet: the engine's AutoTokenizer chooses, recorded
    first_answer = _answer(first)
    first.stop()
    assert PRELOADED not in first.log()
    second = start_server(env=env).wait_ready()
    assert PRELOADED in second.log(), second.log()
    assert _answer(second) == first_answer
