"""Pooling in the engine: runner / conversion resolution and flag errors, a tiny KV cache, tensor
parallelism over real gloo ranks, and the CLI flags."""

from __future__ import annotations

import argparse

import pytest
import torch

from pooling_checkpoints import ENGINE, embed_checkpoint  # noqa: F401  (fixture)
from test_pooling_vs_hf import PROMPTS
from tengyun import LLM
from tengyun.config import EngineConfig
from tengyun.entrypoints.cli.engine_args import add_engine_args, config_from_args
from tengyun.pooling_config import PoolerConfig, apply_hf_overrides, base_architecture, resolve_runner


@pytest.mark.parametrize("architecture, runner, convert, expected", [
    ("Qwen3ForCausalLM", "auto", "auto", ("generate", "none")),
    ("Qwen3ForCausalLM", "pooling", "auto", ("pooling", "embed")),
    ("Qwen3ForCausalLM", "auto", "classify", ("pooling", "classify")),
    ("Qwen3Model", "auto", "auto", ("pooling", "embed")),
    ("Qwen3ForSequenceClassification", "auto", "auto", ("pooling", "classify")),
    ("Qwen2ForRewardModeling", "auto", "auto", ("pooling", "reward")),
])
def test_runner_and_conversion_follow_the_architecture(architecture, runner, convert, expected):
    assert resolve_runner(architecture, runner, convert) == expected


@pytest.mark.parametrize("architecture, runner, convert, words", [
    ("Qwen3Model", "generate", "auto", "--runner pooling"),
    ("Qwen3ForCausalLM", "generate", "embed", "add --runner pooling"),
    ("Qwen3ForCausalLM", "draft", "auto", "--runner draft"),
])
def test_a_runner_that_cannot_run_the_model_is_refused(architecture, runner, convert, words):
    with pytest.raises(ValueError, match=words):
        resolve_runner(architecture, runner, convert)


def test_base_architecture_of_each_pooling_name():
    assert [base_architecture(a) for a in ("Qwen3Model", "Qwen3ForSequenceClassification", "LlamaForCausalLM")] == \
        ["Qwen3ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM"]


def test_hf_overrides_merge_sub_configs_key_by_key():
    config = {"architectures": ["A"], "text_config": {"a": 1, "b": 2}}
    merged = apply_hf_overrides(config, {"architectures": ["B"], "text_config": {"b": 3}, "new": True})
    assert merged == {"architectures": ["B"], "text_config": {"a": 1, "b": 3}, "new": True}
    assert config["text_config"] == {"a": 1, "b": 2}


@pytest.mark.parametrize("value, words", [
    ('{"pooling_type": "max"}', "pooling_type must be one of LAST, MEAN, CLS, ALL"),
    ('{"pooling": "LAST"}', "'pooling' is not a pooler setting"),
    ('{"dimensions": 0}', "dimensions must be a positive integer"),
    ("[1]", "must be a JSON object"),
    ("{", "not valid JSON"),
])
def test_bad_pooler_config_names_the_flag(value, words):
    with pytest.raises(ValueError, match=words):
        PoolerConfig.parse(value)


def test_cli_flags_build_the_pooling_config(embed_checkpoint):  # noqa: F811
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args([str(embed_checkpoint), "--runner", "pooling", "--convert", "embed", "--pooler-config",
                              '{"pooling_type": "mean"}', "--hf-overrides", '{"is_matryoshka": true}'])
    config = config_from_args(args)
    assert config.pooler_config == PoolerConfig(pooling_type="MEAN")
    config.finalize()
    assert (config.pooling.pooling_type, config.pooling.is_matryoshka) == ("MEAN", True)


def test_pooler_config_on_a_generative_model_is_refused(tiny_checkpoints):
    with pytest.raises(ValueError, match="--pooler-config sets a pooling model's pooler: add --runner pooling"):
        EngineConfig(model=str(tiny_checkpoints["qwen3"]), pooler_config={"pooling_type": "MEAN"},
                     kv_cache_memory="32MiB").finalize()


def test_a_generative_llm_refuses_embed(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["qwen3"]), **ENGINE)
    try:
        with pytest.raises(ValueError, match="--runner pooling"):
            llm.embed("hello")
    finally:
        llm.llm_engine.shutdown()


def test_a_tiny_kv_cache_queues_pooling_requests_and_leaks_no_blocks(embed_checkpoint):  # noqa: F811
    """6 prompts of 40 tokens, chunks of 32 tokens, 4 blocks of 16: prompts wait for blocks, run in
    pieces beside each other (MEAN sums every chunk's rows), and give every block back."""
    reference = LLM(str(embed_checkpoint), **ENGINE, pooler_config={"pooling_type": "MEAN"})
    prompts = [[(7 * i + 13 * j) % 290 + 1 for j in range(40)] for i in range(6)]  # token ids
    try:
        expected = [reference.embed(p)[0].outputs.embedding for p in prompts]
    finally:
        reference.llm_engine.shutdown()
    llm = LLM(str(embed_checkpoint), **{**ENGINE, "max_model_len": 64}, pooler_config={"pooling_type": "MEAN"},
              num_gpu_blocks_override=4, block_size=16, max_num_batched_tokens=32, enable_prefix_caching=False)
    try:
        outputs = llm.embed(prompts)
        assert llm.llm_engine.scheduler.block_manager.usage == 0.0
    finally:
        llm.llm_engine.shutdown()
    for output, vector in zip(outputs, expected):
        assert torch.allclose(torch.tensor(output.outputs.embedding), torch.tensor(vector), atol=1e-5)


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_two_ranks_embed_as_one(embed_checkpoint, parallel):  # noqa: F811
    single = LLM(str(embed_checkpoint), **ENGINE)
    try:
        expected = [o.outputs.embedding for o in single.embed(PROMPTS)]
    finally:
        single.llm_engine.shutdown()
    two = LLM(str(embed_checkpoint), **ENGINE, **parallel)
    try:
        got = [o.outputs.embedding for o in two.embed(PROMPTS)]
    finally:
        two.llm_engine.shutdown()
    for a, b in zip(got, expected):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


def test_a_classifier_token_outside_the_vocabulary_is_refused_naming_hf_overrides(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    from tengyun.models.pooling_adapters import classifier_token_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    assert classifier_token_ids(tokenizer, ("<|endoftext|>",)) == (tokenizer.eos_token_id,)
    with pytest.raises(ValueError, match="--hf-overrides classifier_from_token: 'zzyes' is not a token"):
        classifier_token_ids(tokenizer, ("<|endoftext|>", "zzyes"))
