"""The API process's tokenizer: the class AutoTokenizer picked in the engine process, loaded
directly (tokenizer.get_tokenizer's ``same_class_as``), so the front end imports neither torch
nor transformers' model configuration; the same tokenizer as AutoTokenizer's, and AutoTokenizer
wherever that class cannot be used."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

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
