"""The PNG next to a saved `bench serve` result: latency CDFs and output throughput over time."""

from __future__ import annotations

from pathlib import Path

from tengyun.ops.bench import RequestResult, output_rate_over_time


def plot_results(results: list[RequestResult], path: str | Path, title: str = "") -> Path:
    """Two panels: CDFs of TTFT, TPOT, ITL and E2E latency (ms), and output tokens/s over the
    run (1 s bins, or 1/20 of a shorter run) with the number of requests in flight."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to the file
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in results if r.success]
    samples = {"TTFT": [r.ttft for r in ok], "TPOT": [r.tpot for r in ok if r.tpot is not None],
               "ITL": [g for r in ok for g in r.itl], "E2E latency": [r.latency for r in ok]}
    fig, (cdf_ax, rate_ax) = plt.subplots(1, 2, figsize=(13, 4.8))
    for label, values in samples.items():
        if values:
            ms = np.maximum(np.sort(np.asarray(values)) * 1000.0, 1e-3)  # log axis: no zeros
            cdf_ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post", label=f"{label} (n={len(ms)})")
    cdf_ax.set_xscale("log")
    cdf_ax.set(xlabel="ms (log scale)", ylabel="fraction of samples <= x", title="Latency CDFs")
    cdf_ax.grid(True, alpha=0.3)
    cdf_ax.legend(loc="lower right")

    end = max((r.start_time + r.latency for r in ok), default=0.0)
    bin_s = 1.0 if end >= 20 else max(end / 20, 1e-3)  # at least ~20 bars on short runs
    starts, rates = output_rate_over_time(ok, bin_s)
    rate_ax.bar(starts, rates, width=bin_s, align="edge", color="tab:blue", alpha=0.7, label="output tok/s")
    rate_ax.set(xlabel="seconds from start", ylabel="output tokens / s", title="Output throughput over time")
    if starts:
        middles = [t + bin_s / 2 for t in starts]
        in_flight = [sum(r.start_time <= t < r.start_time + r.latency for r in ok) for t in middles]
        twin = rate_ax.twinx()
        twin.plot(middles, in_flight, color="tab:red", drawstyle="steps-mid", label="requests in flight")
        twin.set_ylim(bottom=0)
        twin.set_ylabel("requests in flight")
        twin.legend(loc="upper right")
    rate_ax.legend(loc="upper left")
    rate_ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
