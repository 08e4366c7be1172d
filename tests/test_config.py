"""EngineConfig: vLLM's names, defaults resolved against model and machine, bad values named."""

from __future__ import annotations

import argparse
import json

import pytest

from tengyun import LLM
from tengyun.config import EngineConfig, parse_size


@pytest.mark.parametrize("kwargs, flag", [
    (dict(dtype="float8"), "--dtype"),
    (dict(kv_cache_dtype="int4"), "--kv-cache-dtype"),
    (dict(block_size=3), "--block-size"),
    (dict(max_model_len=0), "--max-model-len"),
    (dict(max_num_seqs=0), "--max-num-seqs"),
    (dict(max_num_batched_tokens=0), "--max-num-batched-tokens"),
    (dict(stream_interval=0), "--stream-interval"),
    (dict(gpu_memory_utilization=1.5), "--gpu-memory-utilization"),
    (dict(kv_cache_memory="lots"), "--kv-cache-memory"),
    (dict(load_format="pt"), "--load-format"),
    (dict(device="tpu"), "--device"),
    (dict(max_logprobs=-2), "--max-logprobs"),
])
def test_bad_values_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        EngineConfig(**kwargs)


def test_sizes_parse_with_units():
    assert parse_size("4GiB", "x") == 4 * 2**30
    assert parse_size("512MB", "x") == 512_000_000
    assert parse_size("1.5KiB", "x") == 1536
    assert parse_size(1024, "x") == 1024


def test_kv_budget_is_4_gib_without_the_flag_or_env_var(monkeypatch):
    monkeypatch.delenv("TENGYUN_CPU_KVCACHE_SPACE", raising=False)  # tests/conftest.py sets it for the suite
    assert EngineConfig().kv_cache_budget_bytes() == 4 * 2**30


def test_kv_budget_env_var(monkeypatch):
    monkeypatch.setenv("TENGYUN_CPU_KVCACHE_SPACE", "2")
    assert EngineConfig().kv_cache_budget_bytes() == 2 * 2**30
    assert EngineConfig(kv_cache_memory="64MiB").kv_cache_budget_bytes() == 64 * 2**20  # the flag wins
    monkeypatch.setenv("TENGYUN_CPU_KVCACHE_SPACE", "abc")
    with pytest.raises(ValueError, match="TENGYUN_CPU_KVCACHE_SPACE"):
        EngineConfig().kv_cache_budget_bytes()


def test_auto_dtypes_resolve_as_this_cpu_serves_a_float32_checkpoint_and_freeze(tiny_checkpoints):
    from tengyun.platforms.cpu.platform import native_bf16

    config = EngineConfig(str(tiny_checkpoints["qwen3"])).finalize()
    served = "bfloat16" if native_bf16() else "float32"  # the tiny checkpoints are float32
    assert (config.dtype, config.kv_cache_dtype, config.device_type) == (served, served, "cpu")
    assert config.max_model_len == 256  # max_position_embeddings
    assert config.max_num_batched_tokens == 2048
    assert config.architecture == "Qwen3ForCausalLM"
    with pytest.raises(AttributeError, match="frozen"):
        config.block_size = 32


def test_serve_on_cpu_defaults_to_512_token_steps_the_llm_class_to_2048_never_below_max_num_seqs(tiny_checkpoints):
    from tengyun.entrypoints.cli.engine_args import add_engine_args, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    model = str(tiny_checkpoints["qwen3"])
    served = config_from_args(parser.parse_args([model]), usage_context="api_server").finalize()
    assert served.max_num_batched_tokens == 512  # CpuPlatform.default_batched_tokens_server
    assert config_from_args(parser.parse_args([model])).finalize().max_num_batched_tokens == 2048
    wide = config_from_args(parser.parse_args([model, "--max-num-seqs", "1024"]), usage_context="api_server")
    assert wide.finalize().max_num_batched_tokens == 1024  # every running decode fits one step
    given = config_from_args(parser.parse_args([model, "--max-num-batched-tokens", "4096"]), usage_context="api_server")
    assert given.finalize().max_num_batched_tokens == 4096  # the flag wins


def test_kv_dtype_follows_an_explicit_model_dtype(tiny_checkpoints):
    config = EngineConfig(str(tiny_checkpoints["llama"]), dtype="bfloat16").finalize()
    assert config.kv_cache_dtype == "bfloat16"


def test_max_model_len_over_the_model_limit_suggests_the_limit(tiny_checkpoints):
    with pytest.raises(ValueError, match=r"--max-model-len 1000 .* lower --max-model-len to 256"):
        EngineConfig(str(tiny_checkpoints["llama"]), max_model_len=1000).finalize()


def test_unchunked_budget_must_hold_a_whole_prompt(tiny_checkpoints):
    with pytest.raises(ValueError, match=r"--max-num-batched-tokens 64 .* --max-model-len 256"):
        EngineConfig(str(tiny_checkpoints["llama"]), enable_chunked_prefill=False,
                     max_num_batched_tokens=64).finalize()


def test_kv_cache_too_small_for_max_model_len_names_both(tiny_checkpoints):
    # llama tiny: 2 (K, V) x 2 layers x 2 kv heads x 16 dims x 4 bytes = 512 B per token -> 128 tokens.
    with pytest.raises(ValueError, match=r"holds 128 tokens .* --max-model-len is 256: lower --max-model-len to 128"):
        LLM(str(tiny_checkpoints["llama"]), kv_cache_memory="64KiB", dtype="float32")


def test_unsupported_architecture_lists_the_supported(tmp_path, tiny_checkpoints):
    import shutil

    folder = tmp_path / "gpt2ish"
    shutil.copytree(tiny_checkpoints["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        LLM(str(folder))


def test_max_logprobs_flag_reaches_the_config():
    import argparse

    from tengyun.entrypoints.cli.engine_args import add_engine_args, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).max_logprobs == 20  # vLLM's default
    assert config_from_args(parser.parse_args(["--max-logprobs", "-1"])).max_logprobs == -1
    assert EngineConfig(max_logprobs=30).max_logprobs == 30  # LLM(max_logprobs=30)


def test_a_quantized_checkpoint_is_refused_naming_its_method(tiny_checkpoints, tmp_path):
    import json
    import shutil

    folder = shutil.copytree(tiny_checkpoints["qwen2"], tmp_path / "bnb")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization method 'bitsandbytes'.*not supported; Tengyun reads: "
                                         ".*compressed-tensors"):
        EngineConfig(str(folder)).finalize()
    assert EngineConfig(str(folder), load_format="dummy").finalize().model_spec.quantization == "bitsandbytes"


def test_quantization_flag_is_vllms_and_forcing_it_on_a_dense_checkpoint_says_what_is_missing(tiny_checkpoints):
    import argparse

    from tengyun.entrypoints.cli.engine_args import add_engine_args, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args(["-q", "compressed-tensors"])).quantization == "compressed-tensors"
    assert config_from_args(parser.parse_args([])).quantization is None
    with pytest.raises(ValueError, match="config_groups is missing"):
        EngineConfig(str(tiny_checkpoints["llama"]), quantization="compressed-tensors").finalize()
    assert EngineConfig(str(tiny_checkpoints["llama"])).finalize().quant_config is None
