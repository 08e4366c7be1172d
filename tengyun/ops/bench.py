"""Load-test workloads and their metrics, as `vllm bench serve` / `vllm bench throughput` count them.

Pure functions: request lists (random tokens, a JSONL file, many prompts behind one shared
prefix), Poisson arrival gaps, and the report (TTFT, TPOT, ITL, E2E latency, throughput,
goodput). The HTTP client is entrypoints/bench/serve.py; the offline run is
entrypoints/bench/throughput.py. All times here are seconds; the report's latencies are ms.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # vLLM's --goodput keys, each in ms
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (90, 99)


@dataclass
class BenchRequest:
    prompt: str | list[int]  # text, or token ids sent as-is (exact prompt length on any server)
    prompt_len: int  # tokens, as the workload built it; a server's usage count replaces it
    output_len: int  # max_tokens


@dataclass
class RequestResult:
    success: bool
    prompt_len: int = 0
    output_len: int = 0  # generated tokens (the server's usage count when it sends one)
    ttft: float = 0.0  # send -> first streamed chunk
    latency: float = 0.0  # send -> last chunk (end-to-end)
    itl: list[float] = field(default_factory=list)  # gaps between successive chunks
    start_time: float = 0.0  # when it was sent, from the start of the run
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for one-token outputs (no decode)."""
        if self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    def chunk_times(self) -> list[float]:
        """Arrival of each chunk, from the start of the run."""
        times = [self.start_time + self.ttft]
        for gap in self.itl:
            times.append(times[-1] + gap)
        return times


# ----- workloads ----------------------------------------------------------------------------
def random_token_ids(rng: random.Random, length: int, vocab_size: int, special_ids: set[int]) -> list[int]:
    ids = []
    while len(ids) < length:
        token = rng.randrange(vocab_size)
        if token not in special_ids:
            ids.append(token)
    return ids


def sample_len(rng: random.Random, length: int, range_ratio: float) -> int:
    """`length` or, with range_ratio r, uniform in [length * (1 - r), length * (1 + r)] (vLLM's
    --random-range-ratio); never below 1."""
    if range_ratio <= 0:
        return length
    low, high = math.floor(length * (1 - range_ratio)), math.ceil(length * (1 + range_ratio))
    return max(1, rng.randint(low, high))


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int, *, prefix_len: int = 0,
                    range_ratio: float = 0.0, special_ids: set[int] | frozenset = frozenset(),
                    seed: int = 0) -> list[BenchRequest]:
    """num_prompts prompts of random token ids: one shared `prefix_len`-token prefix (0 = none),
    then input_len tokens of each prompt's own. The shared-prefix workload is this with a long
    prefix: many requests behind one system prompt."""
    rng = random.Random(seed)
    prefix = random_token_ids(rng, prefix_len, vocab_size, set(special_ids))
    requests = []
    for _ in range(num_prompts):
        own = random_token_ids(rng, sample_len(rng, input_len, range_ratio), vocab_size, set(special_ids))
        requests.append(BenchRequest(prefix + own, prefix_len + len(own), sample_len(rng, output_len, range_ratio)))
    return requests


def jsonl_requests(path: str | Path, num_prompts: int, output_len: int, count_tokens=None) -> list[BenchRequest]:
    """One request per line: {"prompt": "text"} or {"prompt_token_ids": [...]}, optionally
    "output_len" (or "max_tokens") over --output-len. Lines repeat when the file holds fewer
    than num_prompts. count_tokens(text) -> int gives text prompts their length (else 0)."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt_token_ids"] if "prompt_token_ids" in row else row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}, line {number}: expected {{\"prompt\": \"...\"}} or "
                             f"{{\"prompt_token_ids\": [...]}} ({e.__class__.__name__}: {e}).") from None
        length = len(prompt) if isinstance(prompt, list) else (count_tokens(prompt) if count_tokens else 0)
        rows.append(BenchRequest(prompt, length, int(row.get("output_len", row.get("max_tokens", output_len)))))
    if not rows:
        raise ValueError(f"{path} holds no requests: one JSON object per line, e.g. {{\"prompt\": \"Hello\"}}.")
    return [rows[i % len(rows)] for i in range(num_prompts)]


def arrival_gaps(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Seconds to wait before each request: a Poisson process of request_rate per second
    (exponential gaps), or all at once when the rate is inf. The first request goes at once."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive or inf, got {request_rate}.")
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(request_rate) for _ in range(num_requests - 1)]


# ----- metrics ------------------------------------------------------------------------------
def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for spec in specs or []:
        name, sep, value = spec.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput takes KEY:MS pairs with KEY in {', '.join(GOODPUT_METRICS)}, "
                             f"e.g. --goodput ttft:500 tpot:50; got {spec!r}.")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not a number of milliseconds.") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {spec!r}: the limit must not be negative.")
    return slos


def distribution(values_s: list[float]) -> dict[str, float]:
    """Seconds in -> ms out: mean, median, std, p90, p99 (linear interpolation, as numpy and vLLM)."""
    if not values_s:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    stats = {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std())}
    stats.update({f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES})
    return stats


def meets_slo(result: RequestResult, slos: dict[str, float]) -> bool:
    values_ms = {"ttft": result.ttft * 1e3, "tpot": (result.tpot or 0.0) * 1e3, "e2el": result.latency * 1e3}
    return all(values_ms[name] <= limit for name, limit in slos.items())


def compute_metrics(results: list[RequestResult], duration_s: float,
                    slos: dict[str, float] | None = None) -> dict:
    """The numbers `bench serve` prints and saves, with vLLM's JSON keys
    (mean_ttft_ms, p99_tpot_ms, request_goodput, output_throughput, ...)."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    metrics = {
        "duration": duration_s, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "request_goodput": (sum(meets_slo(r, slos) for r in ok) / duration_s) if slos else None,
        "max_output_tokens_per_s": max(output_rate_over_time(ok, 1.0)[1], default=0.0),
    }
    samples = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
               "itl": [gap for r in ok for gap in r.itl], "e2el": [r.latency for r in ok]}
    for name in LATENCY_METRICS:
        for stat, value in distribution(samples[name]).items():
            metrics[f"{stat}_{name}_ms"] = value
    return metrics


def output_rate_over_time(results: list[RequestResult], bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    """Output tokens per second in bins of bin_s from the start of the run: (bin starts, rates).
    A request's tokens are spread evenly over its chunks (a chunk may carry several tokens)."""
    counts: dict[int, float] = {}
    for r in results:
        if not r.success or r.output_len == 0:
            continue
        times = r.chunk_times()
        per_chunk = r.output_len / len(times)
        for t in times:
            counts[int(t // bin_s)] = counts.get(int(t // bin_s), 0.0) + per_chunk
    if not counts:
        return [], []
    bins = range(max(counts) + 1)
    return [b * bin_s for b in bins], [counts.get(b, 0.0) / bin_s for b in bins]


_LABELS = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
           "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}


def format_report(metrics: dict, title: str = "Serving Benchmark Result",
                  max_concurrency: int | None = None, request_rate: float | None = None) -> str:
    """vLLM's `bench serve` block: counts and throughputs, then mean/median/P90/P99 per latency."""
    lines = [f"{' ' + title + ' ':=^50}"]

    def row(label: str, value) -> None:
        lines.append(f"{label:<40}{value:.2f}" if isinstance(value, float) else f"{label:<40}{value}")

    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    if request_rate is not None:
        row("Request rate configured (RPS):", request_rate)
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    row("Benchmark duration (s):", float(metrics["duration"]))
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", float(metrics["request_throughput"]))
    if metrics.get("request_goodput") is not None:
        row("Request goodput (req/s):", float(metrics["request_goodput"]))
    row("Output token throughput (tok/s):", float(metrics["output_throughput"]))
    row("Peak output token throughput (tok/s):", float(metrics["max_output_tokens_per_s"]))
    row("Total token throughput (tok/s):", float(metrics["total_token_throughput"]))
    for name in LATENCY_METRICS:
        heading, short = _LABELS[name]
        lines.append(f"{heading:-^50}")
        row(f"Mean {short} (ms):", float(metrics[f"mean_{name}_ms"]))
        row(f"Median {short} (ms):", float(metrics[f"median_{name}_ms"]))
        for p in PERCENTILES:
            row(f"P{p} {short} (ms):", float(metrics[f"p{p}_{name}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)
