"""One request must never hang, stall or starve the server, nor read its internals: request chat
templates, body sizes, n / prompt limits, lone surrogates, 500 bodies, strict types, the OpenAPI
document. Real server subprocesses on loopback (tiny random Llama), httpx and the openai SDK."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import openai
import pytest

from remote_server import API_KEY, MAX_MODEL_LEN, running_server, server_model, start_server  # noqa: F401

AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON_AUTH = {**AUTH, "Content-Type": "application/json"}
LIMITS = ["--max-n", "4", "--max-prompts-per-request", "3", "--max-seqs-per-request", "6"]
HANG = ("{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}"
        "{% endfor %}{% endfor %}{% endfor %}")
MESSAGES = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def server(server_model, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("hardening") / "server.log"
    yield from running_server(server_model, ["--api-key", API_KEY, "--served-model-name", "hardened", *LIMITS], log)


@pytest.fixture(scope="module")
def trusting_server(server_model, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("hardening_trust") / "server.log"
    yield from running_server(server_model, ["--trust-request-chat-template", "--chat-template-timeout", "2"], log)


def post(server, path: str, body, headers=AUTH, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120, **kwargs)


def post_raw(server, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=raw, headers=JSON_AUTH, timeout=120)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def resident_bytes(server) -> int:
    with open(f"/proc/{server.proc.pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


# ----- chat templates --------------------------------------------------------------------
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_request_chat_template_is_refused_without_the_flag(server, route):
    body = {"messages": MESSAGES, "max_tokens": 2, "chat_template": HANG}
    error = error_of(post(server, route, body), 400)
    assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]
    body = {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"chat_template": HANG}}
    assert error_of(post(server, route, body), 400)["param"] == "chat_template_kwargs"


def test_runaway_template_stops_at_the_limit_while_others_are_served(trusting_server):
    server = trusting_server
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        hostile = pool.submit(post, server, "/v1/chat/completions",
                              {"messages": MESSAGES, "max_tokens": 2, "chat_template": HANG}, {})
        health = []
        while not hostile.done():
            health.append(httpx.get(server.url + "/health", timeout=30).status_code)
            time.sleep(0.05)
        error = error_of(hostile.result(), 400)
    assert "--chat-template-timeout" in error["message"] and error["param"] == "chat_template"
    assert len(health) >= 3 and set(health) == {200}  # the loop answered all along
    normal = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3}, {})
    assert normal.status_code == 200 and normal.json()["usage"]["completion_tokens"] == 3


def test_concurrent_request_completes_while_a_template_runs_away(trusting_server):
    server = trusting_server
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        hostile = pool.submit(post, server, "/v1/chat/completions",
                              {"messages": MESSAGES, "max_tokens": 2, "chat_template": HANG}, {})
        normal = pool.submit(post, server, "/v1/completions", {"prompt": "The quick", "max_tokens": 3}, {})
        assert normal.result().status_code == 200
        assert hostile.result().status_code == 400


# ----- body size -------------------------------------------------------------------------
def test_oversize_body_is_413_from_its_length_without_reading_it(server):
    limit = max(1 << 20, 32 * MAX_MODEL_LEN)
    before = resident_bytes(server)
    body = json.dumps({"prompt": "a" * (10 << 20), "max_tokens": 1}).encode()
    for _ in range(3):
        error = error_of(post_raw(server, "/v1/completions", body), 413)
    assert f"{limit:,}" in error["message"] and "--max-request-bytes" in error["message"]
    assert resident_bytes(server) - before < 8 << 20
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_oversize_chunked_body_is_413_once_it_passes_the_limit(server):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * (1 << 20)
        yield b'", "max_tokens": 1}'

    before = resident_bytes(server)
    response = httpx.post(server.url + "/v1/completions", content=chunks(), headers=JSON_AUTH, timeout=120)
    assert "--max-request-bytes" in error_of(response, 413)["message"]
    assert resident_bytes(server) - before < 8 << 20


def test_body_under_the_limit_but_over_the_context_is_400(server):
    prompt = "The quick brown fox " * 2000  # ~40 kB, thousands of tokens
    error = error_of(post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1}), 400)
    assert "maximum context length" in error["message"]


# ----- n, prompts, sequences -------------------------------------------------------------
@pytest.mark.parametrize("route, body, param, flag", [
    ("/v1/completions", {"prompt": "a", "n": 5}, "n", "--max-n"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 5}, "n", "--max-n"),
    ("/v1/completions", {"prompt": ["a", "b", "c", "d"]}, "prompt", "--max-prompts-per-request"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 3}, "n", "--max-seqs-per-request"),
    ("/v1/completions", {"prompt": "a", "n": 0}, "n", "at least 1"),
])
def test_sequence_limits_name_the_field_and_flag(server, route, body, param, flag):
    error = error_of(post(server, route, {**body, "max_tokens": 1}), 400)
    assert error["param"] == param and flag in error["message"]


def test_n_at_the_limit_is_served(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    answer = client.completions.create(model="hardened", prompt=["a", "b"], n=3, max_tokens=2)
    assert sorted(c.index for c in answer.choices) == list(range(6))


# ----- text that is not Unicode ------------------------------------------------------------
@pytest.mark.parametrize("route, raw, field", [
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "a\ud800b"}]}', "messages.0.content"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "us\udfffer", "content": "a"}]}', "messages.0.role"),
    ("/v1/completions", rb'{"prompt": "a\ud800b", "max_tokens": 1}', "prompt"),
    ("/v1/completions", rb'{"prompt": ["ok", "a\ud800"], "max_tokens": 1}', "prompt.1"),
    ("/tokenize", rb'{"prompt": "a\ud800b"}', "prompt"),
    ("/v1/completions", rb'{"prompt": "a", "logit_bias": {"\ud800": 1}}', "logit_bias.\\ud800"),
])
def test_lone_surrogates_are_400_naming_the_field(server, route, raw, field):
    error = error_of(post_raw(server, route, raw), 400)
    assert error["message"].startswith(f"{field} holds a lone UTF-16 surrogate")


# ----- internal errors ----------------------------------------------------------------------
BREAK_LOGPROBS = """
import sys
import tengyun.entrypoints.openai.serving_completion as serving

def broken(*args, **kwargs):
    raise KeyError("/srv/secret/weights.safetensors")

serving.completion_logprobs = broken
from tengyun.entrypoints.openai.api_server import main
sys.exit(main(sys.argv[1:]))
"""


def test_internal_errors_keep_their_text_in_the_log(start_server):  # noqa: F811
    server = start_server(python_code=BREAK_LOGPROBS).wait_ready()
    body = {"prompt": "a", "max_tokens": 2, "logprobs": 1}
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert full.status_code == 500
    streamed = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=120).text
    for text in (full.text, streamed):
        assert "Internal server error" in text and "secret" not in text and "KeyError" not in text
    assert '"code": 500' in streamed or '"code":500' in streamed
    assert server.log().count("/srv/secret/weights.safetensors") >= 2  # both, with tracebacks, for the operator
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ----- strict types ------------------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "max_tokens": "2"}, "max_tokens"),
    ({"prompt": ["1", 2]}, "prompt"),
    ({"prompt": "a", "n": 2.5}, "n"),
    ({"prompt": "a", "echo": 1}, "echo"),
])
def test_wrong_json_types_are_refused_not_coerced(server, body, param):
    assert error_of(post(server, "/v1/completions", body), 400)["param"] == param


def test_integral_numbers_still_fill_float_fields(server):
    body = {"prompt": "a", "max_tokens": 2, "temperature": 0, "top_p": 1}
    assert post(server, "/v1/completions", body).status_code == 200


# ----- docs and the OpenAPI document ---------------------------------------------------------
@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_docs_need_the_key_when_the_server_has_one(server, path):
    assert httpx.get(server.url + path, timeout=30).status_code == 401
    assert httpx.get(server.url + path, headers=AUTH, timeout=30).status_code == 200


def test_openapi_lists_the_statuses_the_server_answers(server):
    doc = httpx.get(server.url + "/openapi.json", headers=AUTH, timeout=30).json()
    assert "422" not in json.dumps(doc["paths"]) and "HTTPValidationError" not in doc["components"]["schemas"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "401", "413", "503"} <= set(chat)
    assert chat["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "503" in doc["paths"]["/health"]["get"]["responses"]
    assert "401" not in doc["paths"]["/health"]["get"]["responses"]


def test_models_list_reveals_no_folder(server, server_model):  # noqa: F811
    text = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=30).text
    assert json.loads(text)["data"][0]["root"] == "hardened" and str(server_model) not in text


def test_schemathesis_finds_no_server_error(server, tmp_path):
    """schemathesis fuzzes every documented operation from /openapi.json: no 5xx, and every status
    and body it meets is one the document declares."""
    import subprocess
    import sys
    from pathlib import Path

    cli = Path(sys.executable).with_name("schemathesis")
    run = subprocess.run(
        [str(cli), "run", server.url + "/openapi.json", "-H", f"Authorization: Bearer {API_KEY}",
         "--checks", "not_a_server_error,status_code_conformance,response_schema_conformance,"
         "content_type_conformance", "--max-examples", "25", "--seed", "1", "--workers", "1",
         "--request-timeout", "60", "--no-color"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
