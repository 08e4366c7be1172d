"""--generation-config: the model's generation_config.json as default sampling parameters, offline."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest

from conftest import make_tiny_checkpoint
from tengyun.config import EngineConfig
from tengyun.entrypoints.cli.engine_args import add_engine_args, config_from_args
from tengyun.generation_config import generation_config_file, read_sampling_defaults
from tengyun.sampling_params import SamplingParams

QWEN_STYLE = {"bos_token_id": 0, "do_sample": True, "eos_token_id": [0, 1], "pad_token_id": 0,
              "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "min_p": None,
              "max_new_tokens": 512, "transformers_version": "4.37.0"}
PROMPTS = ["hello world", "the quick brown fox"]
ARGS = dict(kv_cache_memory="1MiB", max_model_len=128)


def write_generation_config(folder: Path, fields: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(fields))
    return folder


def test_reads_the_supported_fields_and_renames_max_new_tokens(tmp_path):
    path = write_generation_config(tmp_path, QWEN_STYLE) / "generation_config.json"
    assert read_sampling_defaults(path) == {"repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20,
                                            "top_p": 0.8, "max_tokens": 512}


def test_values_equal_to_transformers_defaults_are_not_model_defaults(tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"top_k": 50, "top_p": 1.0, "temperature": 0.6, "repetition_penalty": 1.0}))
    assert read_sampling_defaults(path) == {"temperature": 0.6}  # as vLLM's to_diff_dict() reading


def test_missing_file_or_vllm_means_no_defaults(tmp_path):
    assert read_sampling_defaults(tmp_path / "generation_config.json") == {}
    assert generation_config_file("vllm", tmp_path) is None
    assert generation_config_file("auto", tmp_path) == tmp_path / "generation_config.json"
    assert generation_config_file(str(tmp_path / "other"), tmp_path) == tmp_path / "other" / "generation_config.json"


def test_bad_value_in_the_file_fails_naming_the_file(tmp_path):
    path = write_generation_config(tmp_path, {"top_p": 0.0}) / "generation_config.json"
    with pytest.raises(ValueError,
                       match=r"generation_config\.json: top_p must be in \(0, 1\].*--generation-config vllm"):
        read_sampling_defaults(path)


@pytest.mark.parametrize("value", ["nonsense", "/no/such/folder"])
def test_unknown_value_or_missing_folder_is_an_error_naming_the_flag(value):
    with pytest.raises(ValueError, match=f"--generation-config '{value}' is not a folder with a generation_config"):
        EngineConfig(generation_config=value)


def test_folder_without_the_file_is_an_error_naming_the_flag_and_path(tmp_path):
    with pytest.raises(ValueError, match=f"--generation-config '{tmp_path}' has no generation_config.json"):
        EngineConfig(generation_config=str(tmp_path))


def test_cli_flag_defaults_to_auto_and_reaches_the_config(tmp_path):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).generation_config == "auto"
    assert config_from_args(parser.parse_args(["--generation-config", "vllm"])).generation_config == "vllm"
    folder = write_generation_config(tmp_path / "gen", {"temperature": 0.5})
    assert config_from_args(parser.parse_args(["--generation-config", str(folder)])).generation_config == str(folder)


@pytest.fixture(scope="module")
def model_with_defaults(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A tiny Llama whose generation_config.json asks for greedy, a strong repetition penalty, 12 tokens."""
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("gen_llama"), tiny_tokenizer_dir, "llama")
    return write_generation_config(folder, {"bos_token_id": 0, "eos_token_id": 0, "do_sample": True,
                                            "temperature": 0.0, "repetition_penalty": 3.0, "max_new_tokens": 12})


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_llm_generate_without_params_uses_the_models_defaults(model_with_defaults, caplog):
    from tengyun import LLM

    with caplog.at_level(logging.INFO, logger="tengyun.generation_config"):
        llm = LLM(str(model_with_defaults), **ARGS)
    assert "overridden by the model's generation config" in caplog.text
    assert "temperature=0.0, max_tokens=12" in caplog.text
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.repetition_penalty, default.max_tokens) == (0.0, 3.0, 12)

    defaulted = token_ids(llm.generate(PROMPTS))
    explicit = token_ids(llm.generate(PROMPTS, SamplingParams(temperature=0.0, repetition_penalty=3.0, max_tokens=12)))
    unpenalized = token_ids(llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12)))
    assert [len(t) for t in defaulted] == [12, 12]
    assert defaulted == explicit
    assert defaulted != unpenalized  # the penalty changes greedy tokens: the default really applied

    chat = llm.chat([{"role": "user", "content": "hello"}])
    assert len(chat[0].outputs[0].token_ids) == 12


def test_llm_with_generation_config_vllm_keeps_sampling_params_defaults(model_with_defaults, caplog):
    from tengyun import LLM

    with caplog.at_level(logging.INFO, logger="tengyun.generation_config"):
        llm = LLM(str(model_with_defaults), generation_config="vllm", **ARGS)
    assert "generation config" not in caplog.text
    assert llm.get_default_sampling_params() == SamplingParams()


def test_llm_reads_another_folders_generation_config(model_with_defaults, tmp_path):
    from tengyun import LLM

    folder = write_generation_config(tmp_path / "gen", {"max_new_tokens": 3, "top_k": 5})
    llm = LLM(str(model_with_defaults), generation_config=str(folder), **ARGS)
    assert llm.get_default_sampling_params() == SamplingParams(max_tokens=3, top_k=5)
    assert [len(t) for t in token_ids(llm.generate(PROMPTS))] == [3, 3]
