"""Where a served request's time went, from the server's own /metrics, for `bench serve`.

Both Tengyun and vLLM export vLLM's per-request histograms; a run's share of each is the
difference of two scrapes (before and after), summed over label sets (`engine="0"`, `"1"`, ...):

    vllm:request_queue_time_seconds      arrival -> first scheduled
    vllm:request_prefill_time_seconds    first scheduled -> first token
    vllm:request_decode_time_seconds     first token -> last token
    vllm:time_to_first_token_seconds     arrival -> first token (the server's TTFT)
    vllm:e2e_request_latency_seconds     arrival -> finished

The client's TTFT (send -> first SSE chunk) minus the server's TTFT is the time outside the
engine's clock: HTTP parsing, tokenisation before arrival, SSE encoding, the event loop, the
socket. Mean per request: sum / count of each histogram over the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

PHASES = (  # (key, histogram, label in the report)
    ("queue", "vllm:request_queue_time_seconds", "Queued (arrival -> scheduled)"),
    ("prefill", "vllm:request_prefill_time_seconds", "Prefill (scheduled -> 1st tok)"),
    ("decode", "vllm:request_decode_time_seconds", "Decode (1st -> last tok)"),
    ("ttft", "vllm:time_to_first_token_seconds", "Server TTFT (arrival -> 1st tok)"),
    ("e2e", "vllm:e2e_request_latency_seconds", "Server E2E (arrival -> end)"),
)


@dataclass(frozen=True)
class HistogramTotal:
    sum_s: float
    count: float


def histogram_totals(metrics_text: str) -> dict[str, HistogramTotal]:
    """Prometheus text -> {histogram name: its _sum and _count over every label set}, for the
    PHASES histograms present in it."""
    wanted = {name for _, name, _ in PHASES}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name not in wanted:
            continue
        for sample in family.samples:
            if sample.name == family.name + "_sum":
                sums[family.name] = sums.get(family.name, 0.0) + sample.value
            elif sample.name == family.name + "_count":
                counts[family.name] = counts.get(family.name, 0.0) + sample.value
    return {name: HistogramTotal(sums.get(name, 0.0), counts[name]) for name in counts}


def timeline(before: dict[str, HistogramTotal], after: dict[str, HistogramTotal]) -> dict[str, dict[str, float]]:
    """{phase key: {"count": observations in the run, "mean_ms": mean per observation}} for the
    phases the server observed during the run."""
    phases = {}
    for key, name, _ in PHASES:
        if name not in after:
            continue
        start = before.get(name, HistogramTotal(0.0, 0.0))
        count = after[name].count - start.count
        if count > 0:
            phases[key] = {"count": count, "mean_ms": 1000.0 * (after[name].sum_s - start.sum_s) / count}
    return phases


def format_timeline(phases: dict[str, dict[str, float]], client_mean_ttft_ms: float) -> str:
    """The report block under `bench serve`'s own: one row per phase, then the client's TTFT
    beside the server's."""
    lines = [f"{'Server timeline (mean per request)':-^50}"]
    if not phases:
        lines.append("the server's /metrics have none of vLLM's per-request histograms")
        return "\n".join(lines)
    for key, _, label in PHASES:
        if key in phases:
            lines.append(f"{label + ' (ms):':<40}{phases[key]['mean_ms']:.2f}")
    if "ttft" in phases:
        lines.append(f"{'Client TTFT (send -> 1st chunk) (ms):':<40}{client_mean_ttft_ms:.2f}")
        lines.append(f"{'  outside the server TTFT (ms):':<40}{client_mean_ttft_ms - phases['ttft']['mean_ms']:.2f}")
    return "\n".join(lines)
