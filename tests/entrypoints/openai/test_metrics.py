"""EngineMetrics and the stats log line, fed engine stats and outputs directly (no server)."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tengyun.engine.llm_engine import EngineStats
from tengyun.entrypoints.openai.metrics import EngineMetrics, StatLogger
from tengyun.outputs import CompletionOutput, RequestMetrics, RequestOutput


def stats(running=0, waiting=0, kv=0.0, queries=0, hits=0, preemptions=0, prompt=0, generation=0) -> EngineStats:
    return EngineStats(num_running=running, num_waiting=waiting, kv_cache_usage=kv, prefix_cache_queries=queries,
                       prefix_cache_hits=hits, num_preemptions=preemptions, prompt_tokens=prompt,
                       generation_tokens=generation)


def output(request_id, n_tokens, times, reasons=None) -> RequestOutput:
    arrival, scheduled, first, last, finished = times
    completions = [CompletionOutput(i, "x" * n_tokens, list(range(n_tokens)), finish_reason=reason)
                   for i, reason in enumerate(reasons or [None])]
    metrics = RequestMetrics(arrival, scheduled, first, last, finished)
    return RequestOutput(request_id, None, [1, 2, 3], completions, finished=all(reasons or [None]), metrics=metrics)


def samples(metrics: EngineMetrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(values, name, **labels):
    return values[(name, tuple(sorted({"model_name": "m", **labels}.items())))]


def test_counters_start_after_warm_up_and_histograms_follow_request_times():
    metrics = EngineMetrics("m")
    metrics.start_from(stats(prompt=5, generation=4, queries=5))  # the warm-up
    metrics.on_step([output("a", 1, (10.0, 10.5, 11.0, 11.0, None))], stats(running=1, kv=0.5, prompt=15,
                                                                            generation=5, queries=15, hits=8))
    metrics.on_step([output("a", 2, (10.0, 10.5, 11.0, 11.25, None))], stats(running=1, kv=0.5, prompt=15,
                                                                             generation=6, queries=15, hits=8))
    metrics.on_step([output("a", 3, (10.0, 10.5, 11.0, 11.75, 12.0), ["length", "stop"])],
                    stats(prompt=15, generation=8, queries=15, hits=8, preemptions=1))
    v = samples(metrics)
    assert value(v, "tengyun:prompt_tokens_total") == 10
    assert value(v, "tengyun:generation_tokens_total") == 4
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
