"""Where the server's API key comes from (--api-key, --api-key-file, $TENGYUN_API_KEY,
$VLLM_API_KEY, in that order), checked on the real server, and the flag combinations it refuses
at start-up (exit 2 naming the flags)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from remote_server import server_model, start_server  # noqa: F401 (fixtures)

KEY = "sk-source-under-test"
PS_WARNING = "--api-key puts the key on the command line"


def status_with_key(url: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.get(url + "/v1/models", headers=headers, timeout=30).status_code


def key_file(tmp_path, text: str):
    path = tmp_path / "api_key"
    path.write_text(text)
    path.chmod(0o600)
    return path


# (flags, environment, a key from a lower-priority source that must be refused)
SOURCES = {
    "flag": (["--api-key", KEY], {"TENGYUN_API_KEY": "sk-env", "VLLM_API_KEY": ""}, "sk-env"),
    "file": (["--api-key-file", "{file}"], {"TENGYUN_API_KEY": "sk-env", "VLLM_API_KEY": ""}, "sk-env"),
    "TENGYUN_API_KEY": ([], {"TENGYUN_API_KEY": KEY, "VLLM_API_KEY": "sk-vllm"}, "sk-vllm"),
    "VLLM_API_KEY": ([], {"TENGYUN_API_KEY": "", "VLLM_API_KEY": KEY}, "sk-wrong"),
}


@pytest.mark.parametrize("source", list(SOURCES))
def test_key_from_each_source_guards_v1_and_outranks_the_next_source(source, start_server, tmp_path):  # noqa: F811
    flags, env, lower = SOURCES[source]
    path = key_file(tmp_path, f"  {KEY}  \nnot the key\n")  # first line, stripped
    server = start_server(*[f.format(file=path) for f in flags], env=env).wait_ready()
    assert status_with_key(server.url, KEY) == 200
    assert status_with_key(server.url, lower) == 401
    assert status_with_key(server.url, None) == 401
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # stays open
    log = server.log()
    assert log.count(PS_WARNING) == (1 if source == "flag" else 0), log
    assert KEY not in log  # the key itself is never logged


def test_no_key_anywhere_means_no_auth(start_server):  # noqa: F811
    server = start_server(env={"TENGYUN_API_KEY": "", "VLLM_API_KEY": ""}).wait_ready()
    assert status_with_key(server.url, None) == 200


def serve_cli(model, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "serve", str(model), "--port", "1",
                           *flags], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("flags, message", [
    (["--api-key-file", "{missing}"], "error: --api-key-file {missing}: cannot read it"),
    (["--api-key-file", "{empty}"], "error: --api-key-file {empty}: the first line is empty"),
    (["--api-key", KEY, "--api-key-file", "{empty}"], "error: --api-key and --api-key-file both give the key"),
    (["--allow-credentials"], "error: --allow-credentials with --allowed-origins '*'"),
    (["--allow-credentials", "--allowed-origins", "https://a.example,*"], "error: --allow-credentials with "
                                                                          "--allowed-origins '*'"),
])
def test_start_up_refuses_bad_key_files_and_credentials_for_any_origin(flags, message, server_model,  # noqa: F811
                                                                       tmp_path):
    paths = {"missing": tmp_path / "no_such_file", "empty": key_file(tmp_path, "\n")}
    r = serve_cli(server_model, *[f.format(**paths) for f in flags])
    assert r.returncode == 2, r.stderr
    assert message.format(**paths) in r.stderr
    assert "Traceback" not in r.stderr
    assert KEY not in r.stderr


def test_credentials_with_listed_origins_start(start_server):  # noqa: F811
    server = start_server("--allow-credentials", "--allowed-origins", "https://app.example").wait_ready()
    r = httpx.options(server.url + "/v1/models", timeout=30, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "GET"})
    assert r.headers.get("access-control-allow-origin") != "https://evil.example"
    r = httpx.get(server.url + "/health", headers={"Origin": "https://app.example"}, timeout=30)
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert r.headers["access-control-allow-credentials"] == "true"
