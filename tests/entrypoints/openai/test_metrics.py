"""Metrics: EngineMetrics and the stats line fed engine stats directly; then the real server on
loopback, scraped with prometheus_client's parser after real requests: every vLLM 0.11 name with
its type, labels and buckets, the same values as its tengyun: twin, exact per-request counts,
the hidden names behind --show-hidden-metrics-for-version, and --disable-vllm-metric-aliases."""

from __future__ import annotations

import argparse

import httpx
import openai
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from remote_server import running_server, server_model, start_server  # noqa: F401 (fixtures)
from tengyun.config import EngineConfig
from tengyun.engine.llm_engine import EngineStats
from tengyun.entrypoints.openai.device_metrics import TENGYUN_ONLY_FAMILIES
from tengyun.entrypoints.openai.metrics import EngineMetrics, StatLogger, buckets_1_2_5
from tengyun.entrypoints.openai.vllm_metrics import hidden_shown
from tengyun.outputs import RequestMetrics, RequestProgress

MODEL = "tiny-llama"


def stats(running=0, waiting=0, kv=0.0, queries=0, hits=0, preemptions=0, prompt=0, generation=0) -> EngineStats:
    return EngineStats(num_running=running, num_waiting=waiting, kv_cache_usage=kv, prefix_cache_queries=queries,
                       prefix_cache_hits=hits, num_preemptions=preemptions, prompt_tokens=prompt,
                       generation_tokens=generation, num_kv_blocks=64)


def output(request_id, n_tokens, times, reasons=None, max_tokens=None) -> RequestProgress:
    arrival, scheduled, first, last, finished = times
    reasons = reasons or [None]
    metrics = RequestMetrics(arrival, scheduled, first, last, finished, max_tokens=max_tokens)
    return RequestProgress(request_id, 3, [n_tokens] * len(reasons), reasons, finished=all(reasons), metrics=metrics)


def engine_metrics(**options) -> EngineMetrics:
    return EngineMetrics(EngineConfig(served_model_name="m", max_model_len=100), **options)


def parse(text: str) -> dict:
    """{(sample name, sorted labels): value}"""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def samples(metrics: EngineMetrics) -> dict:
    return parse(generate_latest(metrics.registry).decode())


def value(values, name, model="m", **labels):
    return values[(name, tuple(sorted({"model_name": model, **labels}.items())))]


def test_counters_start_after_warm_up_and_histograms_follow_request_times():
    metrics = engine_metrics()
    metrics.start_from(stats(prompt=5, generation=4, queries=5))  # the warm-up
    metrics.on_step([output("a", 1, (10.0, 10.5, 11.0, 11.0, None))], stats(running=1, kv=0.5, prompt=15,
                                                                            generation=6, queries=15, hits=8))
    metrics.on_step([output("a", 2, (10.0, 10.5, 11.0, 11.25, None))], stats(running=1, kv=0.5, prompt=15,
                                                                             generation=8, queries=15, hits=8))
    metrics.on_step([output("a", 3, (10.0, 10.5, 11.0, 11.75, 12.0), ["length", "stop"], max_tokens=3)],
                    stats(prompt=15, generation=10, queries=15, hits=8, preemptions=1))
    v = samples(metrics)
    assert value(v, "tengyun:prompt_tokens_total") == 10
    assert value(v, "tengyun:generation_tokens_total") == 6
    assert (value(v, "tengyun:prefix_cache_queries_total"), value(v, "tengyun:prefix_cache_hits_total")) == (10, 8)
    assert value(v, "tengyun:num_preemptions_total") == 1
    assert value(v, "tengyun:num_requests_running") == 0 and value(v, "tengyun:kv_cache_usage_perc") == 0
    assert value(v, "tengyun:request_success_total", finished_reason="length") == 1
    assert value(v, "tengyun:request_success_total", finished_reason="stop") == 1
    assert value(v, "tengyun:request_success_total", finished_reason="abort") == 0
    assert value(v, "tengyun:time_to_first_token_seconds_sum") == 1.0
    assert value(v, "tengyun:inter_token_latency_seconds_count") == 2
    assert value(v, "tengyun:inter_token_latency_seconds_sum") == 0.75
    assert value(v, "tengyun:e2e_request_latency_seconds_sum") == 2.0
    assert value(v, "tengyun:request_queue_time_seconds_sum") == 0.5
    assert value(v, "tengyun:request_prefill_time_seconds_sum") == 0.5
    assert value(v, "tengyun:request_decode_time_seconds_sum") == 0.75
    assert value(v, "tengyun:request_inference_time_seconds_sum") == 1.25
    assert value(v, "tengyun:request_time_per_output_token_seconds_sum") == 0.375  # 0.75 s / (3 - 1) tokens
    # Two sequences of 3 tokens: n 2, 6 generated, longest 3; the prompt [1, 2, 3] once.
    assert [value(v, f"tengyun:{name}_sum") for name in ("request_params_n", "request_generation_tokens",
                                                        "request_max_num_generation_tokens", "request_prompt_tokens",
                                                        "request_params_max_tokens")] == [2, 6, 3, 3, 3]
    # Steps: prompt 3 + 2 tokens, then 2 tokens, then 2 tokens.
    assert value(v, "tengyun:iteration_tokens_total_sum") == 9
    assert value(v, "tengyun:iteration_tokens_total_count") == 3


def test_a_request_aborted_while_waiting_has_no_queue_or_token_times():
    metrics = engine_metrics()
    metrics.start_from(stats())
    metrics.on_step([output("a", 0, (10.0, None, None, None, 10.5), ["abort"], max_tokens=8)], stats())
    v = samples(metrics)
    assert value(v, "tengyun:e2e_request_latency_seconds_count") == 1
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "time_to_first_token_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds", "iteration_tokens_total"):
        assert value(v, f"tengyun:{name}_count") == 0, name
    assert value(v, "tengyun:request_success_total", finished_reason="abort") == 1


def test_token_buckets_run_1_2_5_up_to_max_model_len():
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


def test_hidden_metrics_come_back_for_the_vllm_version_that_still_exported_them():
    assert hidden_shown(None) == {}
    assert set(hidden_shown((0, 10))) == {"gpu_cache_usage_perc", "gpu_prefix_cache_queries",
                                          "gpu_prefix_cache_hits", "time_per_output_token_seconds"}
    assert hidden_shown((0, 9)) == hidden_shown((0, 10))
    assert hidden_shown((0, 11)) == {"time_per_output_token_seconds": "inter_token_latency_seconds"}
    assert hidden_shown((0, 12)) == {}


def test_show_hidden_metrics_flag_takes_x_y_and_names_itself_when_wrong(capsys):
    from tengyun.entrypoints.cli.engine_args import add_dataclass_flags
    from tengyun.entrypoints.openai.server_config import ServerConfig

    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, ServerConfig, only=("show_hidden_metrics_for_version",))
    assert parser.parse_args(["--show-hidden-metrics-for-version", "0.10"]).show_hidden_metrics_for_version == (0, 10)
    assert parser.parse_args(["--show-hidden-metrics-for-version", "0.11.2"]).show_hidden_metrics_for_version == (0, 11)
    with pytest.raises(SystemExit):
        parser.parse_args(["--show-hidden-metrics-for-version", "latest"])
    assert "--show-hidden-metrics-for-version" in capsys.readouterr().err


def test_stats_line_reports_the_interval_and_stays_quiet_when_idle():
    log = StatLogger(10.0)
    log.start_from(stats(prompt=5, generation=4, queries=5), now=100.0)
    assert log.line(now=110.0) is None  # nothing since the warm-up
    log.on_step([], stats(running=2, waiting=1, kv=0.25, prompt=105, generation=54, queries=105, hits=40))
    assert log.line(now=120.0) == ("Engine: prompt 5.0 tok/s, generation 2.5 tok/s, running 2, waiting 1, "
                                   "KV cache 25.0%, prefix cache hit rate 40.0%")
    log.on_step([], stats(prompt=105, generation=74, queries=105, hits=40))
    assert log.line(now=130.0) == ("Engine: prompt 0.0 tok/s, generation 2.0 tok/s, running 0, waiting 0, "
                                   "KV cache 0.0%, prefix cache hit rate 0.0%")
    assert log.line(now=140.0) is None


# ----- the real server -------------------------------------------------------------------
# vLLM 0.11's PrometheusStatLogger, written out from its source: name -> type, and the
# histograms' bucket bounds (token counts: 1, 2, 5, ... up to max_model_len).
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]  # max_model_len 2048
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
           480.0, 960.0, 1920.0, 7680.0]
TOKEN_LATENCY = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0]
VLLM_GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "cache_config_info"]
VLLM_COUNTERS = ["prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
                 "generation_tokens", "request_success"]
VLLM_HISTOGRAMS = {
    "request_prompt_tokens": TOKEN_BUCKETS, "request_generation_tokens": TOKEN_BUCKETS,
    "iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "request_max_num_generation_tokens": TOKEN_BUCKETS, "request_params_n": [1, 2, 5, 10, 20],
    "request_params_max_tokens": TOKEN_BUCKETS,
    "time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "inter_token_latency_seconds": TOKEN_LATENCY, "request_time_per_output_token_seconds": TOKEN_LATENCY,
    "e2e_request_latency_seconds": LATENCY, "request_queue_time_seconds": LATENCY,
    "request_inference_time_seconds": LATENCY, "request_prefill_time_seconds": LATENCY,
    "request_decode_time_seconds": LATENCY,
}
HIDDEN = {"gpu_cache_usage_perc": "gauge", "gpu_prefix_cache_queries": "counter", "gpu_prefix_cache_hits": "counter",
          "time_per_output_token_seconds": "histogram"}


def scrape(server) -> tuple[dict, dict]:
    """({family name: type}, {(sample name, sorted labels): value}) of /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {f.name: f.type for f in text_string_to_metric_families(text)}, parse(text)


def wait_idle(server) -> dict:
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        values = scrape(server)[1]
        if all(value(values, f"tengyun:{g}", MODEL) == 0 for g in VLLM_GAUGES[:3]):
            return values
        time.sleep(0.1)
    pytest.fail("the engine did not go idle")


def bucket_bounds(values: dict, name: str) -> list[float]:
    return sorted(float(dict(labels)["le"]) for sample, labels in values
                  if sample == name + "_bucket" and dict(labels)["le"] != "+Inf")


@pytest.fixture(scope="module")
def server(server_model, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("metrics_server") / "server.log"
    yield from running_server(server_model, ["--served-model-name", MODEL], log)


@pytest.fixture(scope="module")
def traffic(server):
    """Three requests (n 1, 2 and 1; one streamed chat) and the metrics before and after them."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    before = wait_idle(server)
    greedy = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True})
    one = client.completions.create(prompt="The quick brown fox", max_tokens=5, **greedy)
    two = client.completions.create(prompt="Paris is the capital of", max_tokens=3, n=2, **greedy)
    chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "Hello world!"}],
                                                 max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}, **greedy))
    usages = [one.usage, two.usage, chunks[-1].usage]
    return before, wait_idle(server), usages


def test_every_vllm_0_11_metric_is_exported_with_its_type_labels_and_buckets(server, traffic):
    types, values = scrape(server)
    for name in VLLM_GAUGES:
        assert types[f"vllm:{name}"] == types[f"tengyun:{name}"] == "gauge", name
    for name in VLLM_COUNTERS:
        assert types[f"vllm:{name}"] == types[f"tengyun:{name}"] == "counter", name
    for name, bounds in VLLM_HISTOGRAMS.items():
        assert types[f"vllm:{name}"] == types[f"tengyun:{name}"] == "histogram", name
        assert bucket_bounds(values, f"vllm:{name}") == bounds, name
    assert not [name for name in types if name.startswith("vllm:") and name[5:] in HIDDEN]
    for sample, labels in values:
        if sample.startswith("vllm:"):
            names = {k for k, _ in labels} - {"le", "finished_reason"}
            assert "engine" in names and ("model_name" in names or sample == "vllm:cache_config_info"), sample
    reasons = {dict(labels)["finished_reason"] for sample, labels in values if sample == "vllm:request_success_total"}
    assert reasons == {"stop", "length", "abort"}


def test_cache_config_info_holds_the_kv_cache_settings(server, traffic):
    values = scrape(server)[1]
    [(labels, one)] = [(dict(labels), v) for (s, labels), v in values.items() if s == "vllm:cache_config_info"]
    assert one == 1
    assert labels["engine"] == "0" and labels["enable_prefix_caching"] == "True"
    assert int(labels["block_size"]) > 0 and int(labels["num_gpu_blocks"]) > 0
    assert labels["kv_cache_memory_bytes"] == str(64 * 1024 * 1024)  # --kv-cache-memory 64MiB


def test_every_vllm_sample_equals_its_tengyun_twin(server, traffic):
    values = scrape(server)[1]
    twins = 0
    for (sample, labels), v in values.items():
        if sample.startswith("vllm:"):
            tengyun_labels = tuple((k, x) for k, x in labels if k != "engine")
            assert values[("tengyun:" + sample[5:], tengyun_labels)] == v, sample
            twins += 1
    # Device gauges, readiness and response classes have no vLLM name (device_metrics.py).
    tengyun = [s for s, _ in values if s.startswith("tengyun:") and not s.startswith(TENGYUN_ONLY_FAMILIES)]
    assert twins == len(tengyun) > 100


def test_request_histograms_count_exactly_the_requests_sent(server, traffic):
    before, after, usages = traffic

    def delta(name, **labels):
        return value(after, f"vllm:{name}", MODEL, engine="0", **labels) - \
            value(before, f"vllm:{name}", MODEL, engine="0", **labels)

    for name in ("request_params_n", "request_params_max_tokens", "request_prompt_tokens", "request_generation_tokens",
                 "request_max_num_generation_tokens", "e2e_request_latency_seconds", "time_to_first_token_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_time_per_output_token_seconds"):
        assert delta(f"{name}_count") == 3, name
    assert delta("request_params_n_sum") == 1 + 2 + 1
    assert delta("request_params_max_tokens_sum") == 5 + 3 + 4
    assert delta("request_max_num_generation_tokens_sum") == 5 + 3 + 4
    assert delta("request_prompt_tokens_sum") == sum(u.prompt_tokens for u in usages)
    assert delta("request_generation_tokens_sum") == sum(u.completion_tokens for u in usages) == 5 + 2 * 3 + 4
    assert delta("request_success_total", finished_reason="length") == 4  # one per sequence
    assert delta("request_params_n_bucket", le="1.0") == 2 and delta("request_params_n_bucket", le="2.0") == 3
    # Each step's tokens: prompts that got their first token plus tokens generated.
    assert delta("iteration_tokens_total_sum") == delta("prompt_tokens_total") + delta("generation_tokens_total")
    assert delta("generation_tokens_total") == 15
    assert delta("inter_token_latency_seconds_count") == (5 - 1) + (3 - 1) + (4 - 1)


def test_hidden_metrics_appear_with_show_hidden_metrics_for_version(start_server):
    server = start_server("--served-model-name", MODEL, "--show-hidden-metrics-for-version", "0.10").wait_ready()
    httpx.post(server.url + "/v1/completions", timeout=120,
               json={"model": MODEL, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}).raise_for_status()
    types, values = scrape(server)
    assert {name[5:]: types[name] for name in types if name.startswith("vllm:") and name[5:] in HIDDEN} == HIDDEN
    for hidden, current in (("gpu_prefix_cache_queries_total", "prefix_cache_queries_total"),
                            ("time_per_output_token_seconds_count", "inter_token_latency_seconds_count")):
        assert value(values, f"vllm:{hidden}", MODEL, engine="0") == value(values, f"vllm:{current}", MODEL, engine="0")
    assert value(values, "vllm:time_per_output_token_seconds_count", MODEL, engine="0") == 2


def test_disable_vllm_metric_aliases_leaves_only_tengyun_names(start_server):
    server = start_server("--served-model-name", MODEL, "--disable-vllm-metric-aliases").wait_ready()
    types, _ = scrape(server)
    assert not [name for name in types if name.startswith("vllm:")]
    assert "tengyun:iteration_tokens_total" in types and "tengyun:request_params_n" in types
