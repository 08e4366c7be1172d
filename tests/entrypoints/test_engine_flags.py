"""The engine's flags are generated from EngineConfig's fields: one flag per setting, with its
default, choices and help, and a parse that builds the same config as the constructor."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from tengyun.config import DTYPE_ALIASES, SUPPORTED_DTYPES, EngineConfig, setting
from tengyun.entrypoints.cli.engine_args import (
    add_dataclass_flags, add_engine_args, config_from_args, dataclass_kwargs,
)
from tengyun.platforms import platform_class

# A value other than the default for every init field, valid together (2 nodes x 2 ranks each).
NON_DEFAULTS = dict(
    model="some/model-folder", tokenizer="some/tokenizer", dtype="half", kv_cache_dtype="bfloat16", block_size=32,
    max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=512, stream_interval=4, enable_prefix_caching=False,
    enable_chunked_prefill=False, gpu_memory_utilization=0.5, kv_cache_memory="2GiB", num_gpu_blocks_override=64,
    seed=7, load_format="dummy", enforce_eager=True, trust_remote_code=True, device="cpu", served_model_name="m",
    generation_config="vllm", max_logprobs=-1, tensor_parallel_size=2, pipeline_parallel_size=2,
    distributed_executor_backend="mp", nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500,
    disable_pipeline_overlap=True, enable_expert_parallel=True, enable_expert_load_metrics=True,
    data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2, data_parallel_address="10.0.0.1",
    data_parallel_rpc_port=13345,
    headless=True, distributed_timeout=60.5, numa_bind="off", device_init_timeout=30.0, skip_version_check=True,
    rank_table=str(Path(__file__).parents[1] / "fixtures" / "ops" / "hccl_2x2.json"),  # 2 servers x 2 NPUs
    speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}',
    quantization="compressed-tensors",
    enable_lora=True, max_loras=4, max_lora_rank=32, max_cpu_loras=8, lora_dtype="bfloat16", fully_sharded_loras=True,
    runner="pooling", convert="embed", pooler_config='{"pooling_type": "MEAN"}', hf_overrides='{"is_matryoshka": true}',
    enable_prompt_embeds=True, skip_tokenizer_init=True,
)


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tengyun serve")
    add_engine_args(parser)
    return parser


def actions_by_dest(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    actions: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        actions.setdefault(action.dest, []).append(action)
    return actions


def argv_for(cls: type, values: dict) -> list[str]:
    """The command line that sets each field in ``values`` (switches as --x / --no-x)."""
    argv = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            default = cls.__dataclass_fields__[name].default
            argv += [flag] if value else ["--no-" + flag[2:]] if default else []
        else:
            argv += [flag, str(value)]
    return argv


def test_every_init_field_has_exactly_one_flag_with_its_default_and_help():
    actions = actions_by_dest(engine_parser())
    for f in dataclasses.fields(EngineConfig):
        if not f.init or f.name == "model":
            continue
        assert len(actions.get(f.name, [])) == 1, f"{f.name}: expected one flag, got {actions.get(f.name)}"
        action = actions[f.name][0]
        assert "--" + f.name.replace("_", "-") in action.option_strings
        assert action.default == f.default, f.name
        assert action.help, f"{f.name} has no help: give it setting(..., help=...)"
    # model: the positional MODEL and --model (dest model_flag), both defaulting to the embedded model
    assert [a.default for a in actions["model"]] == [None] and actions["model"][0].option_strings == []
    assert actions["model_flag"][0].option_strings == ["--model"]


def test_flag_spellings_choices_and_switches_stay_vllms():
    actions = {a.dest: a for a in engine_parser()._actions}
    assert set(actions["dtype"].choices) == set(SUPPORTED_DTYPES) | {"half", "float", "bf16", "fp16", "fp32"}
    assert set(DTYPE_ALIASES) == {"half", "float", "bf16", "fp16", "fp32"}
    assert actions["tensor_parallel_size"].option_strings == ["--tensor-parallel-size", "-tp"]
    assert actions["pipeline_parallel_size"].option_strings == ["--pipeline-parallel-size", "-pp"]
    assert actions["enable_prefix_caching"].option_strings == ["--enable-prefix-caching", "--no-enable-prefix-caching"]
    for switch in ("enforce_eager", "trust_remote_code", "headless"):  # default False: plain store_true
        assert isinstance(actions[switch], argparse._StoreTrueAction), switch
    assert actions["kv_cache_memory"].type is str  # int | str | None: "4GiB" is parsed by EngineConfig


def test_a_command_line_with_every_flag_builds_the_same_config_as_the_constructor():
    init_fields = {f.name for f in dataclasses.fields(EngineConfig) if f.init}
    assert set(NON_DEFAULTS) == init_fields, "give the new EngineConfig field a non-default value in NON_DEFAULTS"
    for name, value in NON_DEFAULTS.items():
        assert value != EngineConfig.__dataclass_fields__[name].default, name
    parsed = config_from_args(engine_parser().parse_args(argv_for(EngineConfig, NON_DEFAULTS)))
    assert parsed == EngineConfig(**NON_DEFAULTS)
    assert parsed.kv_cache_memory == 2 * 2**30 and parsed.dtype == "float16"


def test_no_flags_build_the_default_config():
    assert config_from_args(engine_parser().parse_args([])) == EngineConfig()


def test_no_enable_prefix_caching_and_short_parallel_flags():
    config = config_from_args(engine_parser().parse_args(["--no-enable-prefix-caching", "-tp", "2", "-pp", "2"]))
    assert config.enable_prefix_caching is False
    assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (2, 2)
    assert config_from_args(engine_parser().parse_args(["--enable-prefix-caching"])).enable_prefix_caching is True


def test_model_positional_and_flag_must_agree():
    parser = engine_parser()
    assert config_from_args(parser.parse_args(["--model", "a"])).model == "a"
    assert config_from_args(parser.parse_args(["a", "--model", "a"])).model == "a"
    with pytest.raises(ValueError, match="MODEL 'a' and --model 'b' disagree"):
        config_from_args(parser.parse_args(["a", "--model", "b"]))


@pytest.mark.parametrize("argv, flag", [
    (["--dtype", "float8"], "--dtype"),
    (["--kv-cache-dtype", "half"], "--kv-cache-dtype"),
    (["--load-format", "pt"], "--load-format"),
    (["--device", "tpu"], "--device"),
    (["--numa-bind", "on"], "--numa-bind"),
    (["--distributed-executor-backend", "ray"], "--distributed-executor-backend"),
    (["-tp", "two"], "--tensor-parallel-size"),
    (["--gpu-memory-utilization", "most"], "--gpu-memory-utilization"),
])
def test_bad_choice_or_type_names_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit):
        engine_parser().parse_args(argv)
    assert re.search(rf"argument {flag}\b.*invalid", capsys.readouterr().err)


def test_block_size_help_states_each_platforms_default():
    from tengyun.platforms.cuda.kernels.attention import PAGE_BLOCK_MULTIPLE

    help_text = next(a.help for a in engine_parser()._actions if a.dest == "block_size")
    per_device = dict(part.split(" ", 1) for part in help_text.split("the platform's: ")[1].rstrip(")").split("; "))
    assert set(per_device) == {"cpu", "cuda", "npu"}
    for device, described in per_device.items():
        sizes = {platform_class(device)().default_block_size}  # CUDA's: what this host's flash-attn gives
        if device == "cuda":
            sizes |= {PAGE_BLOCK_MULTIPLE, platform_class("cpu").default_block_size}  # with and without flash-attn
        for size in sizes:
            assert re.search(rf"\b{size}\b", described), f"{device}'s default block size {size} missing: {help_text}"


@dataclasses.dataclass
class ConfigWithANewSetting(EngineConfig):
    speculative_tokens: int | None = setting(None, help="draft tokens per step (100% made up)", group="speculation")
    draft_model: str = setting("none", help=lambda: "built when the flags are made", choices=("none", "tiny"),
                               aliases=("-dm",))
    disable_draft: bool = setting(True, help="a switch that defaults on")


def test_a_new_setting_gets_a_flag_without_touching_the_cli_module(capsys):
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, ConfigWithANewSetting, skip=("model",))
    actions = {a.dest: a for a in parser._actions}
    assert actions["speculative_tokens"].type is int and actions["speculative_tokens"].default is None
    assert "speculation" in [g.title for g in parser._action_groups]
    assert actions["draft_model"].help == "built when the flags are made"
    args = parser.parse_args(["--speculative-tokens", "4", "-dm", "tiny", "--no-disable-draft", "--seed", "3"])
    config = ConfigWithANewSetting(**dataclass_kwargs(ConfigWithANewSetting, args, skip=("model",)))
    assert (config.speculative_tokens, config.draft_model, config.disable_draft, config.seed) == (4, "tiny", False, 3)
    parser.print_help()  # "%" in a help text is literal
    assert "(100% made up)" in capsys.readouterr().out
