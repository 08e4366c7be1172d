"""Prometheus metrics under `tengyun:` and, as twins, under vLLM's `vllm:` names (vllm_metrics.py),
and the periodic stats log line. Both are step listeners of AsyncLLMEngine: they run on the
event loop after each step that changed a request, fed RequestProgress records (so requests whose
output kind returns nothing until they finish count too). Names, types and buckets are vLLM 0.11's.

    from engine stats     num_requests_running / num_requests_waiting / kv_cache_usage_perc (gauges);
                          prefix_cache_queries / prefix_cache_hits (tokens), num_preemptions,
                          prompt_tokens, generation_tokens (counters); cache_config_info (gauge, 1)
    per step              iteration_tokens_total: prompt tokens of requests that got their first
                          token in the step + tokens generated in it
    per sequence          request_success{finished_reason} (counter)
    per request           time_to_first_token_seconds, inter_token_latency_seconds (each new token
                          step), and when it finishes: e2e_request_latency_seconds,
                          request_queue_time_seconds (arrival -> first scheduled),
                          request_prefill_time_seconds (first scheduled -> first token),
                          request_decode_time_seconds (first token -> last token),
                          request_inference_time_seconds (first scheduled -> last token),
                          request_time_per_output_token_seconds (decode / (tokens - 1)),
                          request_prompt_tokens, request_generation_tokens (all n sequences),
                          request_max_num_generation_tokens (its longest sequence),
                          request_params_n, request_params_max_tokens (as resolved)
    speculative decoding  spec_decode_num_drafts, spec_decode_num_draft_tokens,
    (only when on)        spec_decode_num_accepted_tokens (counters), and
                          spec_decode_num_accepted_tokens_per_pos{position} (counter per draft position)
A request observes the phases it reached: one aborted while waiting has no queue or prefill time.
vLLM counts its per-request histograms once per sequence when n > 1, and leaves client aborts out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics,
)

from tengyun.entrypoints.openai.expert_load_metrics import ExpertLoadCollector
from tengyun.entrypoints.openai.vllm_metrics import VllmMetrics
from tengyun.outputs import FinishReason, RequestProgress
from tengyun.platforms import platform_class

logger = logging.getLogger("tengyun.stats")

PREFIX = "tengyun:"
disable_created_metrics()  # no *_created series next to every counter, as vLLM
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


LORA_INFO_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")  # vLLM's, in its order


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """Token-count buckets up to max_model_len: 100 -> (1, 2, 5, 10, 20, 50, 100)."""
    buckets, scale = [], 1
    while scale <= limit:
        buckets += [m * scale for m in (1, 2, 5) if m * scale <= limit]
        scale *= 10
    return tuple(buckets)


def cache_config_labels(config, num_kv_blocks: int) -> dict[str, str]:
    """cache_config_info's labels: the fields of vLLM 0.11's CacheConfig, as str() writes them,
    holding Tengyun's values (no swap, CPU offload, sliding window or Mamba page padding here)."""
    # device_type is "" until EngineConfig.finalize()
    host_kv = bool(config.device_type) and platform_class(config.device_type).kv_cache_in_host_memory
    return {
        "block_size": str(config.block_size), "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "swap_space": "0", "cache_dtype": str(config.kv_cache_dtype), "is_attention_free": "False",
        "num_gpu_blocks_override": str(config.num_gpu_blocks_override), "sliding_window": "None",
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "prefix_caching_hash_algo": "builtin",  # Python's hash() of (parent hash, token ids)
        "cpu_offload_gb": "0", "calculate_kv_scales": "False",
        "cpu_kvcache_space_bytes": str(config.kv_cache_memory if host_kv else None),
        "mamba_page_size_padded": "None", "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto",
        "num_gpu_blocks": str(num_kv_blocks), "num_cpu_blocks": "None", "kv_sharing_fast_prefill": "False",
        "kv_cache_memory_bytes": str(config.kv_cache_memory), "swap_space_bytes": "0",
    }


@dataclass
class _RequestTiming:
    first_token_seen: bool = False
    last_token_time: float | None = None


class EngineMetrics:
    """Owns its registry, so several servers (tests) can live in one process. `config`: the
    finalized EngineConfig (served_model_name, max_model_len, the cache settings)."""

    def __init__(self, config, registry: CollectorRegistry | None = None, vllm_aliases: bool = True,
                 show_hidden_for: tuple[int, int] | None = None):
        self.config = config
        self.registry = registry or CollectorRegistry()
        ProcessCollector(registry=self.registry)  # resident memory, CPU seconds, open fds
        self.families: dict = {}  # short name -> metric family, read by the vllm: twins at scrape time
        self._add_scheduler_metrics()
        self._add_request_metrics(buckets_1_2_5(config.max_model_len))
        self._add_spec_decode_metrics()
        self.lora_info = self._family(Gauge, "lora_requests_info", "LoRA adapters of the running and waiting "
                                      "requests as labels; the value is when they were last updated (unix time).",
                                      labels=LORA_INFO_LABELS) if config.enable_lora else None
        if vllm_aliases:
            self.registry.register(VllmMetrics(self.families, show_hidden_for))
        elif show_hidden_for is not None:
            logger.warning("--show-hidden-metrics-for-version has no effect with --disable-vllm-metric-aliases: "
                           "the hidden metrics exist only under vllm: names.")
        self._last_stats = None
        self._start_stats = None  # the engine's totals when serving began (start_from)
        self._timings: dict[str, _RequestTiming] = {}
        if getattr(config, "enable_expert_load_metrics", False):
            self.registry.register(ExpertLoadCollector(config.served_model_name, self._expert_load_totals))

    def _family(self, kind, name: str, doc: str, labels=("model_name",), **kwargs):
        if kind is Gauge:  # several API processes (multiprocess_metrics.py): the one that sets them wins
            kwargs.setdefault("multiprocess_mode", "mostrecent")
        family = kind(PREFIX + name, doc, list(labels), registry=self.registry, **kwargs)
        self.families[name] = family
        return family

    def _one(self, kind, name: str, doc: str, **kwargs):
        """The family's only series, {model_name}."""
        return self._family(kind, name, doc, **kwargs).labels(model_name=self.config.served_model_name)

    def _add_scheduler_metrics(self) -> None:
        self.running = self._one(Gauge, "num_requests_running", "Requests in the running batch.")
        self.waiting = self._one(Gauge, "num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = self._one(Gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.cache_info = self._family(Gauge, "cache_config_info", "KV-cache settings as labels (value 1).",
                                       labels=tuple(cache_config_labels(self.config, 0)))
        self.prefix_queries = self._one(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = self._one(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = self._one(Counter, "num_preemptions", "Sequences preempted for lack of KV blocks.")
        self.prompt_tokens = self._one(Counter, "prompt_tokens", "Prompt tokens of accepted requests.")
        self.generation_tokens = self._one(Counter, "generation_tokens", "Generated tokens.")
        self.iteration_tokens = self._one(Histogram, "iteration_tokens_total", "Tokens per engine step: prompts "
                                          "that got their first token plus generated tokens.",
                                          buckets=ITERATION_TOKEN_BUCKETS)

    def _add_request_metrics(self, token_buckets: tuple[int, ...]) -> None:
        success = self._family(Counter, "request_success", "Finished sequences by finish reason.",
                               labels=("model_name", "finished_reason"))
        self.success = {reason.value: success.labels(self.config.served_model_name, reason.value)
                        for reason in FinishReason}
        h = self._histogram
        self.prompt_len = h("request_prompt_tokens", "Prompt tokens of a finished request.", token_buckets)
        self.generation_len = h("request_generation_tokens", "Tokens a finished request generated "
                                "(all its sequences).", token_buckets)
        self.max_generation_len = h("request_max_num_generation_tokens", "Tokens of a finished request's "
                                    "longest sequence.", token_buckets)
        self.n = h("request_params_n", "The n of a finished request.", N_BUCKETS)
        self.max_tokens = h("request_params_max_tokens", "max_tokens of a finished request, as resolved.",
                            token_buckets)
        self.ttft = h("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Time between tokens of a request.", ITL_BUCKETS)
        self.tpot = h("request_time_per_output_token_seconds", "Decode time / (generated tokens - 1) of a "
                      "finished request (0 for one token).", ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue_time = h("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.inference_time = h("request_inference_time_seconds", "First scheduled to last token.", LATENCY_BUCKETS)
        self.prefill_time = h("request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS)
        self.decode_time = h("request_decode_time_seconds", "First token to last token.", LATENCY_BUCKETS)

    def _add_spec_decode_metrics(self) -> None:
        """vLLM's four spec_decode counters, made only when --speculative-config is on (as vLLM)."""
        spec = self.config.speculative_config
        self.spec_counters = {}
        if spec is None:
            return
        for name, doc in (("num_drafts", "Verifications: a sequence's drafts checked in one step."),
                          ("num_draft_tokens", "Draft tokens proposed."),
                          ("num_accepted_tokens", "Draft tokens accepted.")):
            self.spec_counters[name] = self._one(Counter, "spec_decode_" + name, doc)
        per_pos = self._family(Counter, "spec_decode_num_accepted_tokens_per_pos",
                               "Draft tokens accepted, by position in the draft (0 = first).",
                               labels=("model_name", "position"))
        self.spec_per_pos = [per_pos.labels(self.config.served_model_name, str(i))
                             for i in range(spec.num_speculative_tokens)]

    def _record_spec_decode(self, stats, last) -> None:
        """Counters take the increase of the engine's spec-decode totals since the last step."""
        now, before = stats.spec_decode, last.spec_decode if last else None
        if now is None or not self.spec_counters:
            return
        for name, counter in self.spec_counters.items():
            counter.inc(max(getattr(now, name) - (getattr(before, name) if before else 0), 0))
        for pos, counter in enumerate(self.spec_per_pos):
            counter.inc(max(now.num_accepted_tokens_per_pos[pos] -
                            (before.num_accepted_tokens_per_pos[pos] if before else 0), 0))

    def _histogram(self, name: str, doc: str, buckets):
        return self._one(Histogram, name, doc, buckets=buckets)

    def start_from(self, stats) -> None:
        """Count from these engine totals on (the warm-up's tokens are not traffic); the KV
        cache is built by now, so its settings are known."""
        self._last_stats = self._start_stats = stats
        self.cache_info.labels(**cache_config_labels(self.config, stats.num_kv_blocks)).set(1)

    def on_step(self, progress: list[RequestProgress], stats) -> None:
        generated = self._record_stats(stats)
        prefilled = sum(self._record_progress(request) for request in progress)
        if generated or prefilled:
            self.iteration_tokens.observe(prefilled + generated)

    def _record_stats(self, stats) -> int:
        """Set gauges and counters; returns the tokens generated since the last step."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        last = self._last_stats
        increases = {}
        for counter, name in ((self.prefix_queries, "prefix_cache_queries"), (self.prefix_hits, "prefix_cache_hits"),
                              (self.preemptions, "num_preemptions"), (self.prompt_tokens, "prompt_tokens"),
                              (self.generation_tokens, "generation_tokens")):
            # The engine reports running totals; counters take the increase since the last step.
            increases[name] = max(getattr(stats, name) - (getattr(last, name) if last else 0), 0)
            counter.inc(increases[name])
        self._record_spec_decode(stats, last)
        self._record_lora(stats)
        self._last_stats = stats
        return increases["generation_tokens"]

    def _expert_load_totals(self) -> tuple[dict | None, dict | None]:
        """(the latest step's expert-load totals, those at start_from) for ExpertLoadCollector."""
        def totals(stats):
            return stats.expert_load if stats is not None else None

        return totals(self._last_stats), totals(self._start_stats)

    def _record_lora(self, stats) -> None:
        """vllm:lora_requests_info's one series: the adapters now, comma-joined, set to the current time."""
        if self.lora_info is None:
            return
        self.lora_info.clear()
        self.lora_info.labels(max_lora=str(self.config.max_loras), waiting_lora_adapters=",".join(stats.waiting_loras),
                              running_lora_adapters=",".join(stats.running_loras)).set_to_current_time()

    def _record_progress(self, request: RequestProgress) -> int:
        """Latencies of this step's tokens; returns the prompt's length if its first token came now."""
        metrics = request.metrics
        timing = self._timings.setdefault(request.request_id, _RequestTiming())
        prefilled = 0
        if metrics is not None and metrics.first_token_time is not None:
            if not timing.first_token_seen:
                timing.first_token_seen = True
                prefilled = request.num_prompt_tokens
                self.ttft.observe(metrics.first_token_time - metrics.arrival_time)
            elif metrics.last_token_time != timing.last_token_time:
                self.itl.observe(metrics.last_token_time - timing.last_token_time)
            timing.last_token_time = metrics.last_token_time
        if request.finished:
            del self._timings[request.request_id]
            self._record_finished(request)
        return prefilled

    def _record_finished(self, request: RequestProgress) -> None:
        for reason in request.finish_reasons:
            if reason in self.success:
                self.success[reason].inc()
        lengths = request.num_output_tokens  # one per sequence, n in all
        self.prompt_len.observe(request.num_prompt_tokens)
        self.generation_len.observe(sum(lengths))
        self.max_generation_len.observe(max(lengths))
        self.n.observe(len(lengths))
        m = request.metrics
        if m is None:
            return
        if m.max_tokens:
            self.max_tokens.observe(m.max_tokens)
        self.e2e.observe((m.finished_time or time.time()) - m.arrival_time)
        self._record_phases(m, max(lengths))

    def _record_phases(self, m, longest: int) -> None:
        """arrival -queue-> first scheduled -prefill-> first token -decode-> last token; a phase
        is observed once the request reached its end."""
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is None:
            return
        decode = m.last_token_time - m.first_token_time
        self.decode_time.observe(decode)
        self.tpot.observe(decode / (longest - 1) if longest > 1 else 0.0)
        if m.first_scheduled_time is not None:
            self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
            self.inference_time.observe(m.last_token_time - m.first_scheduled_time)


class StatLogger:
    """`Engine: prompt 12.0 tok/s, generation 85.3 tok/s, running 4, waiting 0, KV cache 3.1%,
    prefix cache hit rate 40.0%` every interval while anything happens; with speculative decoding
    `, draft acceptance rate 62.5% (mean acceptance length 2.9)` after it: accepted / drafted
    tokens, and 1 + accepted per verification (tokens a verifying sequence gains per step)."""

    def __init__(self, interval_s: float = 10.0):
        self.interval_s = interval_s
        self._stats = None
        self._logged = None
        self._logged_at = time.monotonic()

    def start_from(self, stats, now: float | None = None) -> None:
        """Rates count from these engine totals on (the warm-up's tokens are not traffic)."""
        self._stats = self._logged = stats
        self._logged_at = time.monotonic() if now is None else now

    def on_step(self, progress: list[RequestProgress], stats) -> None:
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
                f"prefix cache hit rate {100 * hits / queries if queries else 0:.1f}%"
                + _spec_decode_part(stats.spec_decode, last.spec_decode if last else None))

    def log(self) -> None:
        line = self.line()
        if line:
            logger.info(line)


def _spec_decode_part(now, before) -> str:
    """', draft acceptance rate 62.5% (mean acceptance length 2.9)' over the interval; '' when off."""
    if now is None:
        return ""
    drafts = now.num_drafts - (before.num_drafts if before else 0)
    drafted = now.num_draft_tokens - (before.num_draft_tokens if before else 0)
    accepted = now.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
    rate = 100 * accepted / drafted if drafted else 0.0
    length = 1 + accepted / drafts if drafts else 1.0
    return f", draft acceptance rate {rate:.1f}% (mean acceptance length {length:.2f})"
