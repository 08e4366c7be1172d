"""`tengyun deploy nginx` sizes client_max_body_size as the servers size --max-request-bytes, so
nginx and the server refuse the same bodies."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tengyun.entrypoints.openai.request_limits import default_max_request_bytes


def deploy_nginx(*flags: str) -> str:
    run = subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "deploy", "nginx",
                          "--upstream", "127.0.0.1:8001", *flags], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.mark.parametrize("flags, expected", [
    ((), default_max_request_bytes(32768)),
    (("--max-model-len", "262144"), 32 * 262144),
    (("--max-model-len", "262144", "--max-request-bytes", "5000000"), 5_000_000),
])
def test_nginx_body_limit_follows_the_server_limit(flags, expected):
    assert f"client_max_body_size {expected};" in deploy_nginx(*flags)
