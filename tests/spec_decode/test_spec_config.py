"""--speculative-config: vLLM's JSON keys, defaults, and bad input named (ValueError / exit 2)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from tengyun import LLM
from tengyun.config import EngineConfig
from tengyun.entrypoints.cli.engine_args import add_engine_args, config_from_args
from tengyun.spec_decode.config import SpeculativeConfig


def test_ngram_bounds_follow_vllms_defaults():
    parse = SpeculativeConfig.parse
    assert parse('{"method": "ngram", "num_speculative_tokens": 3}') == SpeculativeConfig("ngram", 3, 5, 5)
    assert parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}) == \
        SpeculativeConfig("ngram", 2, 4, 4)
    assert parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}) == \
        SpeculativeConfig("ngram", 2, 2, 2)
    config = SpeculativeConfig("ngram", 4, 1, 3)
    assert parse(config.to_json()) == config
    assert parse(None) is None and parse("") is None


def test_the_flag_and_the_constructor_build_the_same_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
    parsed = config_from_args(parser.parse_args(["--speculative-config", text]))
    assert parsed.speculative_config == SpeculativeConfig("ngram", 3, 2, 4)
    assert parsed == EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_min": 2, "prompt_lookup_max": 4})


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "method must be one of ngram, mtp; got 'eagle'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min 4 is above prompt_lookup_max 2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, r"keys Tengyun does not know: \['model'\]"),
    ({"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 3}, "apply to method ngram only"),
    ("{method: ngram}", "must be a JSON object"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_speculative_config_names_the_field(value, message):
    with pytest.raises(ValueError, match="--speculative-config .*" + message):
        EngineConfig(speculative_config=value)


def test_mtp_on_a_model_without_mtp_weights_is_refused(tiny_checkpoints):
    with pytest.raises(ValueError, match="--speculative-config method mtp needs .* mtp_num_hidden_layers"):
        LLM(str(tiny_checkpoints["llama"]), speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_bad_speculative_config_exits_2_naming_the_field(tiny_checkpoints):
    argv = [sys.executable, "-m", "tengyun.entrypoints.cli.main", "generate", "hi",
            "--model", str(tiny_checkpoints["llama"]),
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}']
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "--speculative-config num_speculative_tokens must be an integer >= 1" in proc.stderr
