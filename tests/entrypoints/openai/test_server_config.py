"""The server's flags are generated from ServerConfig's fields, as the engine's are from
EngineConfig's: the same names, defaults and forms as the hand-written argparse they replace,
one place that refuses bad values naming the flag, and finalize() reading the key and template."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from tengyun.config import EngineConfig
from tengyun.entrypoints.cli.engine_args import add_dataclass_flags, add_engine_args, flag_fields
from tengyun.entrypoints.openai.cli_args import make_arg_parser, server_config_from_args
from tengyun.entrypoints.openai.server_config import ServerConfig

# The flags `tengyun serve` had before ServerConfig, in --help order: flag -> (default, form). Form:
# "switch" (store_true), a value type, or argparse's metavar / nargs / choices where it had them.
# The list flags' default was the list ["*"]; the dataclass keeps the tuple ("*",).
PARSERS = ["hermes", "qwen3_coder"]
OLD_SERVER_FLAGS = {
    "--host": ("0.0.0.0", str), "--port": (8000, int), "--api-key": (None, str),
    "--api-key-file": (None, {"metavar": "PATH"}),
    "--allowed-origins": (("*",), list), "--allowed-methods": (("*",), list), "--allowed-headers": (("*",), list),
    "--allow-credentials": (False, "switch"), "--chat-template": (None, str), "--disable-log-stats": (False, "switch"),
    "--log-stats-interval": (10.0, float), "--device-metrics-interval": (5.0, {"metavar": "SECONDS"}),
    "--disable-log-requests": (False, "switch"), "--shutdown-timeout": (30.0, float),
    "--enable-auto-tool-choice": (False, "switch"), "--tool-call-parser": (None, {"choices": PARSERS}),
    "--reasoning-parser": (None, {"choices": ["deepseek_r1", "qwen3"]}), "--api-server-count": (1, int),
    "--uvicorn-log-level": ("info", {"choices": ["critical", "error", "warning", "info", "debug", "trace"]}),
    "--disable-uvicorn-access-log": (False, "switch"),
    "--disable-vllm-metric-aliases": (False, "switch"), "--show-hidden-metrics-for-version": (None, {"metavar": "X.Y"}),
    "--max-request-bytes": (None, int), "--max-n": (128, int), "--max-prompts-per-request": (256, int),
    "--max-seqs-per-request": (None, int), "--chat-template-timeout": (10.0, float),
    "--trust-request-chat-template": (False, "switch"),
    "--root-path": (None, str), "--uds": (None, {"metavar": "PATH"}),
    "--disable-frontend-multiprocessing": (False, "switch"), "--enable-request-id-headers": (False, "switch"),
    "--enable-server-load-tracking": (False, "switch"), "--enable-tokenizer-info-endpoint": (False, "switch"),
    "--enable-prompt-tokens-details": (False, "switch"), "--return-tokens-as-token-ids": (False, "switch"),
    "--disable-fastapi-docs": (False, "switch"), "--enable-log-requests": (False, "switch"),
    "--max-log-len": (None, str), "--swap-space": (None, str), "--disable-custom-all-reduce": (False, "switch"),
    "--lora-modules": (None, {"nargs": "+", "metavar": "NAME=PATH"}),  # the other LoRA flags are the engine's
    "--limit-mm-per-prompt": (None, {"nargs": "+"}), "--mm-processor-kwargs": (None, {"nargs": "+"}),
    "--mm-processor-cache-gb": (None, {"nargs": "+"}), "--allowed-local-media-path": (None, {"nargs": "+"}),
    "--media-io-kwargs": (None, {"nargs": "+"}),
}
ALIASES = {"--api-server-count": ["-asc"]}  # vLLM's short spellings
GROUPS = {"server": "--host", "metrics": "--disable-vllm-metric-aliases", "request limits": "--max-request-bytes",
          "vLLM compatibility": "--root-path"}  # --help section -> its first flag


def server_actions() -> list[argparse.Action]:
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, ServerConfig)
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_server_flags_are_the_old_ones_with_their_defaults_and_forms():
    actions = server_actions()
    assert [a.option_strings for a in actions] == [[flag, *ALIASES.get(flag, [])] for flag in OLD_SERVER_FLAGS]
    for action in actions:
        default, form = OLD_SERVER_FLAGS[action.option_strings[0]]
        assert action.default == default, action.option_strings
        if form == "switch":
            assert isinstance(action, argparse._StoreTrueAction), action.option_strings
        elif form is list:
            assert action.type('["a", "b"]') == ["a", "b"] and action.type("a, b") == ["a", "b"]
        elif isinstance(form, dict):
            assert {key: _listed(getattr(action, key)) for key in form} == form, action.option_strings
        else:
            assert action.type is form and action.nargs is None and action.metavar is None, action.option_strings


def _listed(value):
    return list(value) if isinstance(value, tuple) else value


def test_serve_takes_every_server_field_once_in_its_help_group():
    parser = make_arg_parser(argparse.ArgumentParser())
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    assert len(flags) == len(set(flags))
    assert {"--" + f.name.replace("_", "-") for f in flag_fields(ServerConfig)} == set(OLD_SERVER_FLAGS)
    groups = {g.title: g._group_actions[0].option_strings for g in parser._action_groups if g._group_actions}
    groups = {title: flags[0] for title, flags in groups.items() if flags}  # not the positional MODEL
    assert {title: groups[title] for title in GROUPS} == GROUPS
    assert list(groups)[-4:] == list(GROUPS)  # after the engine's


def test_parsed_flags_build_the_config_the_constructor_builds():
    parser = make_arg_parser(argparse.ArgumentParser())
    assert server_config_from_args(parser.parse_args(["model"])) == ServerConfig()
    argv = ["model", "--port", "9000", "--allowed-origins", '["https://a.example", "https://b.example"]',
            "--allow-credentials", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
            "--show-hidden-metrics-for-version", "0.10.2", "--max-n", "4", "--limit-mm-per-prompt", '{"image": 0}',
            "--enable-server-load-tracking", "--device-metrics-interval", "0"]
    assert server_config_from_args(parser.parse_args(argv)) == ServerConfig(
        port=9000, allowed_origins=("https://a.example", "https://b.example"), allow_credentials=True,
        tool_call_parser="hermes", enable_auto_tool_choice=True, show_hidden_metrics_for_version=(0, 10), max_n=4,
        limit_mm_per_prompt=('{"image": 0}',), enable_server_load_tracking=True, device_metrics_interval=0.0)


@pytest.mark.parametrize("values, flag", [
    (dict(device_metrics_interval=-1), "--device-metrics-interval -1: give seconds"),
    (dict(api_key="k", api_key_file="/k"), "--api-key and --api-key-file"),
    (dict(enable_auto_tool_choice=True), "--enable-auto-tool-choice needs --tool-call-parser"),
    (dict(allow_credentials=True), "--allow-credentials with --allowed-origins '\\*'"),
    (dict(lora_modules=("sql",)), "--lora-modules 'sql': give name=path"),
    (dict(lora_modules=('{"name": "sql"}',)), "a JSON entry needs \"name\" and \"path\""),
    (dict(limit_mm_per_prompt=('{"image": 1}',)), "--limit-mm-per-prompt: multimodal"),
    (dict(max_n=0), "--max-n must be positive, got 0"),
    (dict(max_request_bytes=-5), "--max-request-bytes must be positive, got -5"),
    (dict(chat_template_timeout=0.0), "--chat-template-timeout must be positive"),
])
def test_a_bad_value_is_refused_naming_its_flag(values, flag):
    with pytest.raises(ValueError, match=flag):
        ServerConfig(**values)


def test_a_value_argparse_cannot_read_names_the_flag(capsys):
    parser = make_arg_parser(argparse.ArgumentParser())
    for argv, flag in ((["--port", "http"], "--port"), (["--allowed-origins", "[1]"], "--allowed-origins"),
                       (["--runner", "fast"], "--runner"), (["--convert", "pool"], "--convert")):
        with pytest.raises(SystemExit):
            parser.parse_args(["model", *argv])
        assert f"argument {flag}" in capsys.readouterr().err


def test_request_limits_follow_the_engine_where_unset():
    limits = ServerConfig(max_request_bytes=0).request_limits(max_model_len=131072, max_num_seqs=8)
    assert (limits.max_request_bytes, limits.max_seqs_per_request, limits.max_n) == (4 << 20, 8, 128)
    limits = ServerConfig(max_request_bytes=1000, max_seqs_per_request=3).request_limits(131072, 8)
    assert (limits.max_request_bytes, limits.max_seqs_per_request) == (1000, 3)


def test_finalize_reads_the_key_file_then_the_environment_and_the_template_file(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm-env")
    monkeypatch.delenv("TENGYUN_API_KEY", raising=False)
    assert ServerConfig().finalize().required_api_key == "from-vllm-env"
    monkeypatch.setenv("TENGYUN_API_KEY", "from-env")
    assert ServerConfig().finalize().required_api_key == "from-env"
    (tmp_path / "key").write_text("  from-file \nignored\n")
    (tmp_path / "template.jinja").write_text("{{ messages }}")
    server = ServerConfig(api_key_file=str(tmp_path / "key"), chat_template=str(tmp_path / "template.jinja"))
    assert (server.finalize().required_api_key, server.chat_template_text) == ("from-file", "{{ messages }}")
    assert server.chat_template == str(tmp_path / "template.jinja")  # the flag's value stays as given
    with pytest.raises(ValueError, match="--chat-template 'chatml' is neither a file nor a Jinja template"):
        ServerConfig(chat_template="chatml").finalize()


def test_engine_flags_are_generated_as_before():
    """The generator now reads Annotated[..., Flag(...)]; EngineConfig's flags carry none of it."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for action in parser._actions:
        if action.dest in EngineConfig.__dataclass_fields__ and action.dest != "model":
            assert action.metavar is None and action.nargs in (None, 0), action.dest
    assert dataclasses.fields(ServerConfig)[-2].name == "required_api_key"  # init=False: no flag
