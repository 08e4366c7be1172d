"""The API process's tokenizer: the class AutoTokenizer picked in the engine process, loaded
directly (tokenizer.get_tokenizer's ``same_class_as``), so the front end imports neither torch
nor transformers' model configuration; the same tokenizer as AutoTokenizer's, and AutoTokenizer
wherever that class cannot be used. The engine's: AutoTokenizer's choice recorded per folder
(tokenizer_classes), loaded directly at later starts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tengyun import tokenizer_classes
from tengyun.tokenizer import class_path, get_tokenizer


def _config(folder, trust_remote_code=False):
    return SimpleNamespace(tokenizer_path=folder, trust_remote_code=trust_remote_code)


def _auto(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_engines_class_gives_autotokenizers_tokenizer(tiny_checkpoints, arch):
    folder = tiny_checkpoints[arch]
    auto = _auto(folder)
    direct = get_tokenizer(_config(folder), class_path(auto))
    assert type(direct) is type(auto)
    text = "Hello, world: tokens and <|endoftext|> too."
    assert direct.encode(text) == auto.encode(text)
    assert direct.eos_token_id == auto.eos_token_id and direct.all_special_ids == auto.all_special_ids
    assert direct.decode(auto.encode(text)) == auto.decode(auto.encode(text))


@pytest.mark.parametrize("path", ["json.decoder:JSONDecoder",  # outside transformers
                                  "transformers:NoSuchTokenizer", "transformers.nowhere:Tokenizer"])
def test_a_class_that_cannot_be_used_falls_back_to_autotokenizer(tiny_checkpoints, path):
    folder = tiny_checkpoints["qwen2"]
    assert type(get_tokenizer(_config(folder), path)) is type(_auto(folder))


def test_remote_code_always_goes_through_autotokenizer(tiny_checkpoints, monkeypatch):
    import tengyun.tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "_load_class", lambda *args: pytest.fail("loaded by class"))
    folder = tiny_checkpoints["qwen2"]
    get_tokenizer(_config(folder, trust_remote_code=True), class_path(_auto(folder)))


def test_loading_by_class_imports_no_torch(tiny_checkpoints):
    """What the API process saves (~60 MiB RSS on the default model: 383 -> 320 MiB measured)."""
    folder = tiny_checkpoints["qwen2"]
    script = (f"import sys; from types import SimpleNamespace; from tengyun.tokenizer import get_tokenizer\n"
              f"t = get_tokenizer(SimpleNamespace(tokenizer_path={str(folder)!r}, trust_remote_code=False), "
              f"{class_path(_auto(folder))!r})\n"
              f"print(type(t).__name__, 'torch' in sys.modules, 'transformers.configuration_utils' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[1:] == ["False", "False"]


def _start(folder, cache) -> list[str]:
    """A fresh process's get_tokenizer(folder) with TENGYUN_CACHE_DIR=cache (an engine's start):
    [class name, whether AutoConfig imported a model type's configuration module, token ids]."""
    script = (f"import sys; from types import SimpleNamespace; from tengyun.tokenizer import get_tokenizer\n"
              f"t = get_tokenizer(SimpleNamespace(tokenizer_path={str(folder)!r}, trust_remote_code=False))\n"
              f"auto_config = any(m.startswith('transformers.models.') and '.configuration_' in m "
              f"for m in sys.modules)\n"
              f"print(type(t).__name__, auto_config, t.encode('Hello, world: <|endoftext|> too.'))")
    name, auto_config, ids = _run(script, cache).split(" ", 2)
    return [name, auto_config, ids]


def _run(script: str, cache) -> str:
    """What ``script`` printed, run in a fresh process with TENGYUN_CACHE_DIR=cache."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TENGYUN_CACHE_DIR": str(cache)})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_later_start_loads_the_recorded_class_without_autoconfig(tiny_checkpoints, tmp_path):
    folder = shutil.copytree(tiny_checkpoints["qwen2"], tmp_path / "model")
    first = _start(folder, tmp_path / "cache")
    assert first[1] == "True"  # AutoTokenizer, which read the config through AutoConfig
    assert len(list((tmp_path / "cache" / tokenizer_classes.RECORDS).iterdir())) == 1  # its choice, recorded
    second = _start(folder, tmp_path / "cache")
    assert second == [first[0], "False", first[2]]  # the same tokenizer, no model configuration imported
    os.utime(folder / "tokenizer_config.json", ns=(1, 1))  # an edited file: AutoTokenizer decides again
    assert _start(folder, tmp_path / "cache")[1] == "True"


def test_a_recorded_class_that_no_longer_loads_falls_back_and_is_recorded_again(tiny_checkpoints, tmp_path,
                                                                                monkeypatch):
    monkeypatch.setenv("TENGYUN_CACHE_DIR", str(tmp_path))
    folder = tiny_checkpoints["llama"]
    path = tokenizer_classes.record_path(folder)
    path.parent.mkdir(parents=True)
    path.write_text("transformers:NoSuchTokenizer\n")
    auto = _auto(folder)
    assert type(get_tokenizer(_config(folder))) is type(auto)
    assert tokenizer_classes.recorded_class(folder) == class_path(auto)


def test_remote_code_is_never_recorded(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("TENGYUN_CACHE_DIR", str(tmp_path))
    folder = tiny_checkpoints["qwen2"]
    get_tokenizer(_config(folder, trust_remote_code=True))
    assert tokenizer_classes.recorded_class(folder) is None and not (tmp_path / tokenizer_classes.RECORDS).exists()


def _preload(folder, cache, trust_remote_code=False) -> str:
    """A fresh process's preload_tokenizer(folder) (the API process while its engine loads):
    "None", or "module:class <whether torch got imported> <token ids>"."""
    script = (f"import sys; from types import SimpleNamespace; from tengyun.tokenizer import preload_tokenizer\n"
              f"got = preload_tokenizer(SimpleNamespace(tokenizer_path={str(folder)!r}, "
              f"trust_remote_code={trust_remote_code}))\n"
              f"print(got if got is None else f\"{{got[0]}} {{'torch' in sys.modules}} "
              f"{{got[1].encode('Hello, world: <|endoftext|> too.')}}\")")
    return _run(script, cache)


def test_the_api_process_preloads_the_recorded_class_without_torch(tiny_checkpoints, tmp_path):
    folder = shutil.copytree(tiny_checkpoints["qwen2"], tmp_path / "model")
    assert _preload(folder, tmp_path / "cache") == "None"  # a first start: the engine's AutoTokenizer chooses
    first = _start(folder, tmp_path / "cache")  # the engine's start, which records its choice
    auto = _auto(folder)
    assert _preload(folder, tmp_path / "cache") == \
        f"{class_path(auto)} False {auto.encode('Hello, world: <|endoftext|> too.')}" == \
        f"{class_path(auto)} False {first[2]}"
    assert _preload(folder, tmp_path / "cache", trust_remote_code=True) == "None"  # AutoTokenizer's, later
