"""tengyun.ops.bench: workloads and the `bench serve` report, on hand-made timings.

Times are multiples of 1/8 s so every sum is exact; interpolated percentiles are compared
to 1e-9 ms."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from tengyun.ops.bench import (
    RequestResult, arrival_gaps, compute_metrics, format_report, jsonl_requests, output_rate_over_time,
    parse_goodput, random_requests,
)


def hand_made() -> list[RequestResult]:
    return [
        # chunks at 0.125, 0.25, 0.375, 0.5, 0.625: TPOT (0.625 - 0.125) / 4 = 0.125
        RequestResult(True, prompt_len=10, output_len=5, ttft=0.125, latency=0.625, itl=[0.125] * 4, start_time=0.0),
        # sent at 0.5, chunks at 0.75, 1.0, 1.5: TPOT (1.0 - 0.25) / 2 = 0.375
        RequestResult(True, prompt_len=20, output_len=3, ttft=0.25, latency=1.0, itl=[0.25, 0.5], start_time=0.5),
        # one token: no TPOT, no ITL
        RequestResult(True, prompt_len=30, output_len=1, ttft=0.5, latency=0.5, itl=[], start_time=1.0),
        RequestResult(False, prompt_len=40, start_time=0.0, error="HTTP 500"),
    ]


def approx(value):
    return pytest.approx(value, abs=1e-9)


def test_counts_and_throughputs_exclude_failed_requests():
    m = compute_metrics(hand_made(), duration_s=2.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 9)
    assert m["request_throughput"] == 1.5
    assert m["output_throughput"] == 4.5
    assert m["total_token_throughput"] == 34.5
    assert m["request_goodput"] is None  # no --goodput given


def test_ttft_and_e2e_distributions_in_ms():
    m = compute_metrics(hand_made(), duration_s=2.0)
    # TTFT ms [125, 250, 500]; p90 = 250 + 0.8 * (500 - 250) (linear interpolation, as numpy)
    assert m["mean_ttft_ms"] == approx(875 / 3)
    assert m["median_ttft_ms"] == 250.0
    assert m["std_ttft_ms"] == approx(statistics.pstdev([125, 250, 500]))
    assert m["p90_ttft_ms"] == approx(450.0)
    assert m["p99_ttft_ms"] == approx(495.0)
    # E2E ms [625, 1000, 500]
    assert m["mean_e2el_ms"] == approx(2125 / 3)
    assert m["median_e2el_ms"] == 625.0
    assert m["p90_e2el_ms"] == approx(625 + 0.8 * 375)
    assert m["p99_e2el_ms"] == approx(625 + 0.98 * 375)


def test_tpot_excludes_the_first_token_and_one_token_outputs():
    results = hand_made()
    assert [r.tpot for r in results[:3]] == [0.125, 0.375, None]
    m = compute_metrics(results, duration_s=2.0)
    assert m["mean_tpot_ms"] == 250.0 and m["median_tpot_ms"] == 250.0
    assert m["p90_tpot_ms"] == approx(125 + 0.9 * 250)
    assert m["p99_tpot_ms"] == approx(125 + 0.99 * 250)


def test_itl_pools_every_gap_of_every_request():
    m = compute_metrics(hand_made(), duration_s=2.0)
    # ITL ms [125, 125, 125, 125, 250, 500]
    assert m["mean_itl_ms"] == approx(1250 / 6)
    assert m["median_itl_ms"] == 125.0
    assert m["p90_itl_ms"] == approx(250 + 0.5 * 250)
    assert m["p99_itl_ms"] == approx(250 + 0.95 * 250)


def test_goodput_counts_requests_meeting_every_slo():
    # ttft <= 300 and tpot <= 200: only the first (125, 125); the third's 500 ms TTFT fails
    assert compute_metrics(hand_made(), 2.0, parse_goodput(["ttft:300", "tpot:200"]))["request_goodput"] == 0.5
    # e2el <= 700: the first (625) and the third (500); a one-token request passes any TPOT limit
    assert compute_metrics(hand_made(), 2.0, {"e2el": 700.0, "tpot": 0.0})["request_goodput"] == 0.5
    assert compute_metrics(hand_made(), 2.0, {"e2el": 700.0})["request_goodput"] == 1.0


def test_goodput_flag_parsing_names_the_valid_keys():
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2el:2000"]) == {"ttft": 500.0, "tpot": 50.5, "e2el": 2000.0}
    assert parse_goodput(None) == {}
    for bad, words in (("itl:5", "ttft, tpot, e2el"), ("ttft", "KEY:MS"), ("ttft:fast", "not a number"),
                       ("tpot:-1", "negative")):
        with pytest.raises(ValueError, match=words):
            parse_goodput([bad])


def test_output_rate_over_time_bins_chunks_by_second():
    # bin 0: five chunks of the first request and the second's 0.75; bin 1: 1.0, 1.5, and the third's 1.5
    starts, rates = output_rate_over_time(hand_made(), 1.0)
    assert (starts, rates) == ([0.0, 1.0], [6.0, 3.0])
    assert compute_metrics(hand_made(), 2.0)["max_output_tokens_per_s"] == 6.0
    # four tokens in two chunks (a server that batches its stream): two tokens per chunk
    two_chunks = RequestResult(True, output_len=4, ttft=0.5, latency=1.5, itl=[1.0], start_time=0.0)
    assert output_rate_over_time([two_chunks], 0.5) == ([0.0, 0.5, 1.0, 1.5], [0.0, 4.0, 0.0, 4.0])


def test_report_has_vllm_rows():
    metrics = compute_metrics(hand_made(), 2.0, {"ttft": 300.0, "tpot": 200.0})
    report = format_report(metrics, max_concurrency=4).splitlines()
    for label, value in (("Successful requests:", "3"), ("Failed requests:", "1"),
                         ("Maximum request concurrency:", "4"), ("Request goodput (req/s):", "0.50"),
                         ("Output token throughput (tok/s):", "4.50"), ("Median TTFT (ms):", "250.00"),
                         ("P90 TPOT (ms):", "350.00"), ("P99 ITL (ms):", "487.50"), ("Mean E2EL (ms):", "708.33")):
        assert f"{label:<40}{value}" in report


def test_random_prompts_have_exact_lengths_a_shared_prefix_and_no_special_ids():
    requests = random_requests(5, 7, 3, vocab_size=20, prefix_len=4, special_ids={0, 1}, seed=3)
    assert [(len(r.prompt), r.prompt_len, r.output_len) for r in requests] == [(11, 11, 3)] * 5
    assert len({tuple(r.prompt[:4]) for r in requests}) == 1  # one shared prefix
    assert len({tuple(r.prompt[4:]) for r in requests}) == 5  # each its own suffix
    assert all(2 <= t < 20 for r in requests for t in r.prompt)
    assert random_requests(5, 7, 3, vocab_size=20, prefix_len=4, special_ids={0, 1}, seed=3) == requests
    assert random_requests(5, 7, 3, vocab_size=20, seed=4) != random_requests(5, 7, 3, vocab_size=20, seed=3)


def test_range_ratio_spreads_lengths_within_bounds():
    requests = random_requests(200, 100, 10, vocab_size=50, range_ratio=0.5, seed=0)
    assert min(r.prompt_len for r in requests) >= 50 and max(r.prompt_len for r in requests) <= 150
    assert len({r.prompt_len for r in requests}) > 20
    assert all(5 <= r.output_len <= 15 for r in requests)


def test_poisson_gaps_average_one_over_the_rate():
    assert arrival_gaps(4, math.inf) == [0.0] * 4
    gaps = arrival_gaps(20001, 4.0, seed=0)
    assert gaps[0] == 0.0 and gaps == arrival_gaps(20001, 4.0, seed=0)
    assert statistics.fmean(gaps[1:]) == pytest.approx(0.25, rel=0.03)
    with pytest.raises(ValueError, match="--request-rate"):
        arrival_gaps(3, 0.0)


def test_jsonl_prompts_text_or_ids_with_per_line_output_len(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt": "a b c"}) + "\n\n" +
                    json.dumps({"prompt_token_ids": [5, 6], "output_len": 3}) + "\n")
    requests = jsonl_requests(path, 3, 8, count_tokens=lambda text: len(text.split()))
    assert [(r.prompt, r.prompt_len, r.output_len) for r in requests] == [
        ("a b c", 3, 8), ([5, 6], 2, 3), ("a b c", 3, 8)]  # repeats when the file is short
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="line 2"):
        jsonl_requests(path, 1, 8)


def test_bench_math_imports_neither_torch_nor_the_engine():
    import subprocess
    import sys

    code = ("import sys, tengyun.ops.bench, tengyun.ops.bench_plot; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('tengyun.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
