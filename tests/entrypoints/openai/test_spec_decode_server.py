"""Speculative decoding through the server: --speculative-config on `tengyun serve`'s API server
answers the OpenAI SDK with the tokens the engine gives without it, exports vLLM's four
spec_decode counters (tengyun: and vllm: twins), and a bad value exits 2 naming the field.
The metrics and the stats line are also fed engine stats directly."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from remote_server import running_server, server_model, start_server  # noqa: F401 (fixtures)
from tengyun import LLM, SamplingParams
from tengyun.config import EngineConfig
from tengyun.engine.llm_engine import EngineStats
from tengyun.entrypoints.openai.metrics import EngineMetrics, StatLogger
from tengyun.spec_decode.stats import SpecDecodeStats

MODEL = "tiny-llama"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[7, 7, 9, 7, 7, 9, 7], [9, 9, 9, 9, 9, 2, 9], [5, 17, 29, 41, 5, 17, 29]]
BIAS = {7: 6.0, 9: 6.0}
SPEC_COUNTERS = ["spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"]


def parse(text: str) -> dict:
    """{(sample name, sorted labels): value}"""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def counter(values: dict, prefix: str, name: str, model: str, **labels) -> float:
    """A counter's value; vllm: twins carry engine="0"."""
    labels = {"model_name": model, **({"engine": "0"} if prefix == "vllm:" else {}), **labels}
    return values[(prefix + name + "_total", tuple(sorted(labels.items())))]


def engine_stats(spec: SpecDecodeStats | None, generation: int = 0) -> EngineStats:
    return EngineStats(num_running=1, num_waiting=0, kv_cache_usage=0.5, prefix_cache_queries=0, prefix_cache_hits=0,
                       num_preemptions=0, prompt_tokens=10, generation_tokens=generation, num_kv_blocks=64,
                       spec_decode=spec)


def test_spec_counters_take_the_increase_of_the_engine_totals():
    config = EngineConfig(served_model_name="m", max_model_len=100, speculative_config=NGRAM)
    metrics = EngineMetrics(config)
    metrics.start_from(engine_stats(SpecDecodeStats(3, 2, 6, 3, [2, 1, 0])))  # the warm-up
    metrics.on_step([], engine_stats(SpecDecodeStats(3, 5, 14, 9, [5, 3, 1])))
    values = parse(generate_latest(metrics.registry).decode())
    for prefix in ("tengyun:", "vllm:"):
        assert [counter(values, prefix, name, "m") for name in SPEC_COUNTERS] == [3, 8, 6]
        assert [counter(values, prefix, "spec_decode_num_accepted_tokens_per_pos", "m", position=str(p))
                for p in range(3)] == [3, 2, 1]


def test_spec_metrics_exist_only_with_speculative_config():
    names = {name for name, _ in parse(generate_latest(EngineMetrics(
        EngineConfig(served_model_name="m", max_model_len=100)).registry).decode())}
    assert not [name for name in names if "spec_decode" in name]


def test_stats_line_gives_the_intervals_acceptance_rate():
    log = StatLogger(10.0)
    log.start_from(engine_stats(SpecDecodeStats(3, 2, 6, 3, [2, 1, 0])), now=100.0)
    log.on_step([], engine_stats(SpecDecodeStats(3, 6, 14, 9, [5, 3, 1]), generation=40))
    assert log.line(now=110.0).endswith(", draft acceptance rate 75.0% (mean acceptance length 2.50)")
    log.on_step([], engine_stats(None, generation=50))
    assert "acceptance" not in log.line(now=120.0)


@pytest.fixture(scope="module")
def server(server_model, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("spec_server") / "server.log"
    yield from running_server(server_model, ["--served-model-name", MODEL, "--speculative-config",
                                             json.dumps(NGRAM)], log)


def test_openai_client_gets_the_tokens_of_the_engine_without_speculation(server, server_model):  # noqa: F811
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    answers = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                         logit_bias={str(k): v for k, v in BIAS.items()},
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
               for prompt in PROMPTS]
    llm = LLM(str(server_model), max_model_len=256, kv_cache_memory="16MiB")
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias=BIAS))
    assert [a.choices[0].text for a in answers] == [e.outputs[0].text for e in expected]
    values = parse(httpx.get(server.url + "/metrics", timeout=30).text)
    for prefix in ("tengyun:", "vllm:"):
        drafts, drafted, accepted = (counter(values, prefix, name, MODEL) for name in SPEC_COUNTERS)
        per_pos = [counter(values, prefix, "spec_decode_num_accepted_tokens_per_pos", MODEL, position=str(p))
                   for p in range(3)]
        assert 0 < accepted < drafted <= 3 * drafts and sum(per_pos) == accepted


def test_bad_speculative_config_exits_2_naming_the_field(start_server):  # noqa: F811
    server = start_server("--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}')
    assert server.wait_exit() == 2
    assert "--speculative-config method must be one of ngram, mtp; got 'medusa'" in server.log()
