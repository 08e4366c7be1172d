"""bench serve's server timeline: vLLM's per-request histograms, as prometheus_client writes them
(with vLLM's `engine` label on two replicas), read back and differenced over a run."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from tengyun.ops.bench_timeline import PHASES, format_timeline, histogram_totals, timeline


def _registry():
    registry = CollectorRegistry()
    hists = {key: Histogram(name.replace("vllm:", "vllm_").removesuffix("_seconds") + "_seconds", "h",
                            ["model_name", "engine"], registry=registry) for key, name, _ in PHASES}
    return registry, hists


def _text(registry) -> str:
    # prometheus_client cannot name a metric with ':'; vLLM's names are written as servers write them
    return generate_latest(registry).decode().replace("vllm_", "vllm:")


def test_run_means_are_the_difference_of_two_scrapes_over_every_engine():
    registry, hists = _registry()
    hists["queue"].labels("m", "0").observe(5.0)  # before the run
    before = histogram_totals(_text(registry))
    hists["queue"].labels("m", "0").observe(0.010)
    hists["queue"].labels("m", "1").observe(0.030)
    hists["ttft"].labels("m", "0").observe(0.200)
    hists["ttft"].labels("m", "1").observe(0.400)
    phases = timeline(before, histogram_totals(_text(registry)))
    assert set(phases) == {"queue", "ttft"}  # prefill / decode / e2e observed nothing in the run
    assert phases["queue"] == {"count": 2, "mean_ms": pytest.approx(20.0)}
    assert phases["ttft"] == {"count": 2, "mean_ms": pytest.approx(300.0)}
    rows = dict(line.rsplit(":", 1) for line in format_timeline(phases, client_mean_ttft_ms=350.0).splitlines()[1:])
    assert {label: float(value) for label, value in rows.items()} == {
        "Queued (arrival -> scheduled) (ms)": 20.0, "Server TTFT (arrival -> 1st tok) (ms)": 300.0,
        "Client TTFT (send -> 1st chunk) (ms)": 350.0, "  outside the server TTFT (ms)": 50.0}


def test_a_server_without_the_histograms_says_so():
    assert histogram_totals("# HELP x y\n# TYPE x counter\nx_total 3.0\n") == {}
    assert "none of vLLM's per-request histograms" in format_timeline({}, 1.0)
