"""Prometheus metrics (vLLM's names under `tengyun:`, label model_name) and the periodic stats
log line. Both are step listeners of AsyncLLMEngine: they run on the event loop after each step.

    tengyun:num_requests_running / num_requests_waiting / kv_cache_usage_perc    gauges
    tengyun:prefix_cache_queries_total / prefix_cache_hits_total (tokens),
    tengyun:num_preemptions_total, prompt_tokens_total, generation_tokens_total,
    tengyun:request_success_total{finished_reason}                               counters
    tengyun:time_to_first_token_seconds, inter_token_latency_seconds,
    tengyun:e2e_request_latency_seconds, request_queue_time_seconds             histograms
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics,
)

from tengyun.outputs import FinishReason, RequestOutput

logger = logging.getLogger("tengyun.stats")

PREFIX = "tengyun:"
disable_created_metrics()  # no *_created series next to every counter, as vLLM
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class _RequestTiming:
    first_token_seen: bool = False
    last_token_time: float | None = None


class EngineMetrics:
    """Owns its registry, so several servers (tests) can live in one process."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        ProcessCollector(registry=self.registry)  # resident memory, CPU seconds, open fds
        labels = {"model_name": model_name}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, ["model_name"], registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name"], registry=r).labels(**labels)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=r).labels(**labels)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted for lack of KV blocks.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of accepted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        success = Counter(PREFIX + "request_success", "Finished sequences by finish reason.",
                          ["model_name", "finished_reason"], registry=r)
        self.success = {reason.value: success.labels(model_name=model_name, finished_reason=reason.value)
                        for reason in FinishReason}
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens of a request.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self._last_stats = None
        self._timings: dict[str, _RequestTiming] = {}

    def start_from(self, stats) -> None:
        """Count from these engine totals on (the warm-up's tokens are not traffic)."""
        self._last_stats = stats

    def on_step(self, outputs: list[RequestOutput], stats) -> None:
        self._record_stats(stats)
        for output in outputs:
            self._record_output(output)

    def _record_stats(self, stats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        last = self._last_stats
        for counter, name in ((self.prefix_queries, "prefix_cache_queries"), (self.prefix_hits, "prefix_cache_hits"),
                              (self.preemptions, "num_preemptions"), (self.prompt_tokens, "prompt_tokens"),
                              (self.generation_tokens, "generation_tokens")):
            # The engine reports running totals; counters take the increase since the last step.
            counter.inc(max(getattr(stats, name) - (getattr(last, name) if last else 0), 0))
        self._last_stats = stats

    def _record_output(self, output: RequestOutput) -> None:
        metrics = output.metrics
        timing = self._timings.setdefault(output.request_id, _RequestTiming())
        if metrics is not None and metrics.first_token_time is not None:
            if not timing.first_token_seen:
                timing.first_token_seen = True
                self.ttft.observe(metrics.first_token_time - metrics.arrival_time)
            elif metrics.last_token_time != timing.last_token_time:
                self.itl.observe(metrics.last_token_time - timing.last_token_time)
            timing.last_token_time = metrics.last_token_time
        if output.finished:
            del self._timings[output.request_id]
            for c in output.outputs:
                if c.finish_reason in self.success:
                    self.success[c.finish_reason].inc()
            if metrics is not None:
                self.e2e.observe((metrics.finished_time or time.time()) - metrics.arrival_time)
                if metrics.first_scheduled_time is not None:
                    self.queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)


class StatLogger:
    """`Engine: prompt 12.0 tok/s, generation 85.3 tok/s, running 4, waiting 0, KV cache 3.1%,
    prefix cache hit rate 40.0%` every interval while anything happens."""

    def __init__(self, interval_s: float = 10.0):
        self.interval_s = interval_s
        self._stats = None
        self._logged = None
        self._logged_at = time.monotonic()

    def start_from(self, stats, now: float | None = None) -> None:
        """Rates count from these engine totals on (the warm-up's tokens are not traffic)."""
        self._stats = self._logged = stats
        self._logged_at = time.monotonic() if now is None else now

    def on_step(self, outputs: list[RequestOutput], stats) -> None:
        self._stats = stats

    def line(self, now: float | None = None) -> str | None:
        """The line for the interval just ended, or None when nothing happened in it."""
        now = time.monotonic() if now is None else now
        stats, last = self._stats, self._logged
        if stats is None or (stats == last and stats.num_running == 0 and stats.num_waiting == 0):
            return None
        elapsed = max(now - self._logged_at, 1e-9)
        prompt = stats.prompt_tokens - (last.prompt_tokens if last else 0)
        generation = stats.generation_tokens - (last.generation_tokens if last else 0)
        queries = stats.prefix_cache_queries - (last.prefix_cache_queries if last else 0)
        hits = stats.prefix_cache_hits - (last.prefix_cache_hits if last else 0)
        self._logged, self._logged_at = stats, now
        return (f"Engine: prompt {prompt / elapsed:.1f} tok/s, generation {generation / elapsed:.1f} tok/s, "
                f"running {stats.num_running}, waiting {stats.num_waiting}, "
                f"KV cache {stats.kv_cache_usage * 100:.1f}%, "
                f"prefix cache hit rate {100 * hits / queries if queries else 0:.1f}%")

    def log(self) -> None:
        line = self.line()
        if line:
            logger.info(line)
