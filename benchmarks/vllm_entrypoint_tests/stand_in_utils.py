"""Stand-in for vLLM's tests/utils.py: RemoteOpenAIServer starts `tengyun serve` instead of `vllm serve`.

adapt.py copies this file over tests/utils.py in the work copy of vLLM's tests. It keeps the
interface the OpenAI entrypoint tests use (constructor arguments, url_for, url_root, uds, proc,
show_hidden_metrics, get_client, get_async_client, DUMMY_API_KEY, VLLM_PATH) and nothing else.

What differs from vLLM's own fixture, on purpose:
- the command: $TENGYUN_PYTHON -m tengyun.entrypoints.openai.api_server MODEL ARGS
  (with $TENGYUN_SRC first on PYTHONPATH when set, to test a snapshot of the source);
- no pre-download of the model and no parse of the args with vLLM's parser: the args go to
  Tengyun as the test wrote them, so an unknown flag fails the start as a user would see it;
- translations, only where the stand-in model cannot take the test's args or a flag that is not
  the test's subject would stop the start (each one logged on stderr): model-specific
  flags of a model that was swapped for a text-generation one (`--limit-mm-per-prompt` of a
  vision model) are dropped;
  `--structured-outputs-config.backend` and `--tool-server` are dropped; `--reasoning-parser deepseek_r1` becomes
  `qwen3` (the same <think> format, Tengyun's name for it); `--dtype half|float16|bfloat16` is
  replaced by `--dtype float32` (GPU half precision, 2-12x slower than float32 on this CPU; Tengyun's
  own `--dtype auto` picks bfloat16 on a CPU with avx512_bf16, so float32 is named);
- the server's start-up wait is $STAND_IN_START_TIMEOUT seconds (default 240, vLLM's) when the test
  gives none: on a shared 2-core machine a 0.5B model with LoRA slots may need longer.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import httpx
import openai
import requests

VLLM_PATH = Path(__file__).parent.parent
"""Root of the work copy (tests/ and examples/ of vLLM's sdist)."""

TENGYUN_PYTHON = os.environ.get("TENGYUN_PYTHON", "/work/main/.venv/bin/python")
TENGYUN_SRC = os.environ.get("TENGYUN_SRC", "")  # e.g. a `git archive HEAD` snapshot
START_TIMEOUT = float(os.environ.get("STAND_IN_START_TIMEOUT", "240"))

# flag -> number of values it takes (-1: every value up to the next --flag)
# flags that belong to the original (non text-generation) model the test named
SWAPPED_MODEL_FLAGS = {"--limit-mm-per-prompt": 1}
# vLLM flags Tengyun refuses at start-up although the test's subject is something else: dropped,
# so the test measures its subject (the refusals are reported on their own in the README)
# (--tool-server: gpt-oss's built-in browser / python tools, which the Harmony tests that use them
# skip in vLLM's CI; the rest of test_response_api_with_harmony is the Responses API itself)
NOT_THE_SUBJECT_FLAGS = {"--structured-outputs-config.backend": 1, "--tool-server": 1}
# Half precision the tests ask for "for speed and memory savings in CI" (their comments) on a GPU;
# on this CPU Tengyun decodes it 2-12x slower than float32 (README), so the tests' time limits
# would measure that instead of their subject. Replaced by float32 (the precision run 3 measured).
HALF_DTYPES = {"half", "float16", "fp16", "bfloat16", "bf16"}
# vLLM's reasoning parser for Qwen3 / QwQ (<think>...</think>) has another name here
REASONING_PARSER_NAMES = {"deepseek_r1": "qwen3"}


def get_open_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _drop_flags(args: list[str], flags: dict[str, int], why: str) -> list[str]:
    out, i = [], 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name in flags:
            n = 0 if "=" in args[i] else flags[name]
            j = i + 1
            if n < 0:
                while j < len(args) and not args[j].startswith("--"):
                    j += 1
            else:
                j += n
            print(f"[stand-in] dropped {' '.join(args[i:j])} ({why})", file=sys.stderr)
            i = j
            continue
        out.append(args[i])
        i += 1
    return out


def translate_args(args: list[str]) -> list[str]:
    args = _drop_flags(args, SWAPPED_MODEL_FLAGS, "flag of the swapped-out model")
    args = _drop_flags(args, NOT_THE_SUBJECT_FLAGS, "refused by Tengyun, not the test's subject")
    args = _rename_reasoning_parser(args)
    return _half_dtype_to_float32(args)


def _half_dtype_to_float32(args: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if a.startswith("--dtype="):
            value = a.split("=", 1)[1]
        else:
            value = args[i + 1] if a == "--dtype" and i + 1 < len(args) else None
        if value in HALF_DTYPES:
            print(f"[stand-in] --dtype {value} -> float32 (GPU half precision; float32 on this CPU)",
                  file=sys.stderr)
            out += ["--dtype", "float32"]
            i += 1 if "=" in a else 2
            continue
        out.append(a)
        i += 1
    return out


def _rename_reasoning_parser(args: list[str]) -> list[str]:
    out = list(args)
    for i, a in enumerate(out[:-1]):
        if a == "--reasoning-parser" and out[i + 1] in REASONING_PARSER_NAMES:
            new = REASONING_PARSER_NAMES[out[i + 1]]
            print(f"[stand-in] --reasoning-parser {out[i + 1]} -> {new} (same <think> format)", file=sys.stderr)
            out[i + 1] = new
    return out


def _flag_value(args: list[str], *names: str) -> Optional[str]:
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"  # as vLLM's: the server needs no key unless --api-key

    def _start_server(self, model: str, serve_args: list[str], env_dict: Optional[dict[str, str]]) -> None:
        env = os.environ.copy()
        env["HF_HUB_OFFLINE"] = "1"
        if TENGYUN_SRC:
            env["PYTHONPATH"] = TENGYUN_SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        if env_dict is not None:
            env.update(env_dict)
        cmd = [TENGYUN_PYTHON, "-m", "tengyun.entrypoints.openai.api_server", model, *serve_args]
        print("[stand-in] " + " ".join(cmd), file=sys.stderr)
        self.proc: subprocess.Popen = subprocess.Popen(cmd, env=env, stdout=sys.stdout, stderr=sys.stderr)

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: Optional[dict[str, str]] = None,
                 seed: Optional[int] = 0, auto_port: bool = True, max_wait_seconds: Optional[float] = None,
                 override_hf_configs: Optional[dict[str, Any]] = None) -> None:
        import json

        args = translate_args(list(vllm_serve_args))
        if auto_port:
            if "-p" in args or "--port" in args:
                raise ValueError("You have manually specified the port when `auto_port=True`.")
            if "--uds" not in args:
                args = args + ["--port", str(get_open_port())]
        if seed is not None:
            if "--seed" in args:
                raise ValueError(f"You have manually specified the seed when `seed={seed}`.")
            args = args + ["--seed", str(seed)]
        if override_hf_configs is not None:
            args = args + ["--hf-overrides", json.dumps(override_hf_configs)]

        self.uds = _flag_value(args, "--uds")
        if self.uds:
            self.host = None
            self.port = None
        else:
            self.host = _flag_value(args, "--host") or "localhost"
            self.port = int(_flag_value(args, "--port", "-p"))
        self.show_hidden_metrics = _flag_value(args, "--show-hidden-metrics-for-version") is not None

        self._start_server(model, args, env_dict)
        self._wait_for_server(url=self.url_for("health"), timeout=max_wait_seconds or START_TIMEOUT)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        self.proc.terminate()
        try:
            self.proc.wait(8)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _poll(self) -> Optional[int]:
        return self.proc.poll()

    def _wait_for_server(self, *, url: str, timeout: float):
        start = time.time()
        client = httpx.Client(transport=httpx.HTTPTransport(uds=self.uds)) if self.uds else requests
        while True:
            with contextlib.suppress(Exception):
                if client.get(url).status_code == 200:
                    return
            result = self._poll()
            if result is not None:
                # vLLM's fixture raises only on a non-zero exit; a server that exits 0 before it is
                # ready would loop until the timeout there. Same message, sooner.
                raise RuntimeError(f"Server exited unexpectedly (exit code {result}).") from None
            time.sleep(0.5)
            if time.time() - start > timeout:
                self.proc.kill()
                raise RuntimeError("Server failed to start in time.") from None

    @property
    def url_root(self) -> str:
        return f"http://{self.uds.split('/')[-1]}" if self.uds else f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return self.url_root + "/" + "/".join(parts)

    def get_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)


class RemoteOpenAIServerCustom(RemoteOpenAIServer):
    """vLLM's variant runs a Python function as the server process; here it still runs Tengyun."""

    def __init__(self, model: str, vllm_serve_args: list[str],
                 child_process_fxn: Callable[[Optional[dict[str, str]], str, list[str]], None], *,
                 env_dict: Optional[dict[str, str]] = None, seed: Optional[int] = 0, auto_port: bool = True,
                 max_wait_seconds: Optional[float] = None) -> None:
        super().__init__(model, vllm_serve_args, env_dict=env_dict, seed=seed, auto_port=auto_port,
                         max_wait_seconds=max_wait_seconds)
