"""Long flags spelled with underscores, as vLLM's command line takes them (`--data_parallel_size 1`
in vLLM's own test_multi_api_servers): the same flag, values untouched, on every entry point."""

from __future__ import annotations

import pytest

from tengyun.entrypoints.cli import main as cli_main
from tengyun.entrypoints.cli.flexible_parser import FlexibleArgumentParser, dashed_flags
from tengyun.entrypoints.cli.supervise import parse_serve_args, pop_api_key, serve_command
from tengyun.entrypoints.openai import api_server
from tengyun.entrypoints.openai.cli_args import make_arg_parser


def test_only_flag_names_change_and_nothing_after_a_bare_double_dash():
    assert dashed_flags(["m", "--max_model_len=4_096", "--lora-modules", "my_lora=/a_b", "-O", "x_y",
                         "--structured_outputs_config.backend_name", "a", "--", "--x_y"]) == [
        "m", "--max-model-len=4_096", "--lora-modules", "my_lora=/a_b", "-O", "x_y",
        "--structured-outputs-config.backend_name", "a", "--", "--x_y"]


def test_serve_flags_with_underscores_build_the_same_namespace_as_with_dashes():
    parser = make_arg_parser(FlexibleArgumentParser())
    underscored = parser.parse_args(["m", "--data_parallel_size", "1", "--max_model_len=64", "--api_server_count",
                                     "2", "--enable_prompt_embeds", "--served_model_name", "a_b"])
    dashed = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["m", "--data-parallel-size", "1", "--max-model-len=64", "--api-server-count", "2",
         "--enable-prompt-embeds", "--served-model-name", "a_b"])
    assert vars(underscored) == vars(dashed)
    assert underscored.max_model_len == 64 and underscored.served_model_name == "a_b"


@pytest.mark.parametrize("entry", ["tengyun", "api_server"])
def test_each_entry_point_reads_an_underscored_flag_as_that_flag(entry, capsys):
    # a bad value makes argparse name the flag it matched (exit 2) before anything starts;
    # without the rewrite it would be "unrecognized arguments: --max_num_seqs"
    argv = ["m", "--max_num_seqs", "many"]
    with pytest.raises(SystemExit) as exit_info:
        cli_main.main(["serve", *argv]) if entry == "tengyun" else api_server.main(argv)
    assert exit_info.value.code == 2
    assert "argument --max-num-seqs: invalid int value: 'many'" in capsys.readouterr().err


def test_supervise_reads_the_serve_flags_after_its_double_dash_the_same_way():
    serve_args = serve_command(["--", "serve", "m", "--api_key", "K", "--max_model_len", "64"])
    args, key = pop_api_key(serve_args)  # the key never reaches the child's command line
    assert key == "K" and "K" not in args
    assert parse_serve_args(args).max_model_len == 64
