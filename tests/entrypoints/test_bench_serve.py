"""`tengyun bench serve` end to end: the real CLI against a real tiny-model server; its token
counts must equal the increase of the server's own /metrics counters."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent / "openai"))
from remote_server import running_server, server_model  # noqa: E402,F401 (fixture)

SERVED = "tiny-bench"


@pytest.fixture(scope="module")
def server(server_model, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("bench_server") / "server.log"
    yield from running_server(server_model, ["--served-model-name", SERVED, "--disable-log-stats"], log)


def token_counters(server) -> tuple[float, float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return values["tengyun:prompt_tokens_total"], values["tengyun:generation_tokens_total"]


def counters_after(server, before: tuple[float, float], expected: tuple[int, int]) -> tuple[float, float]:
    """The counters once they reach `expected` increases (the last step's listener may run just
    after the last chunk left), or whatever they are after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        now = token_counters(server)
        delta = (now[0] - before[0], now[1] - before[1])
        if delta == expected or time.monotonic() > deadline:
            return delta
        time.sleep(0.1)


def bench(*flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tengyun.entrypoints.cli.main", "bench", "serve", "--disable-tqdm", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_random_workload_counts_match_server_metrics_and_result_is_saved(server, server_model, tmp_path):  # noqa: F811
    before = token_counters(server)
    proc = bench("--base-url", server.url, "--model", str(server_model), "--served-model-name", SERVED,
                 "--dataset", "random", "--input-len", "24", "--output-len", "6", "--num-prompts", "5",
                 "--request-rate", "50", "--max-concurrency", "2", "--ignore-eos",
                 "--goodput", "ttft:600000", "tpot:600000", "--save-result", "--result-dir", str(tmp_path),
                 "--result-filename", "run.json", "--server-pid", str(server.proc.pid))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "Maximum request concurrency:            2" in proc.stdout
    result = json.loads((tmp_path / "run.json").read_text())
    # the server's own timeline over exactly these 5 requests, from its vllm: histograms
    assert {k: v["count"] for k, v in result["server_timeline"].items()} == {
        "queue": 5, "prefill": 5, "decode": 5, "ttft": 5, "e2e": 5}
    assert "Server timeline (mean per request)" in proc.stdout and "outside the server TTFT" in proc.stdout
    # the API process and the engine process under it, each with the CPU it spent in the run
    cpu = result["server_cpu"]
    assert cpu[0]["pid"] == server.proc.pid and len(cpu) >= 2 and sum(p["cpu_s"] for p in cpu) > 0
    assert (result["completed"], result["failed"]) == (5, 0)
    assert result["input_lens"] == [24] * 5 and result["output_lens"] == [6] * 5
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (120, 30)
    assert counters_after(server, before, (120, 30)) == (120, 30)
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # SLOs every request meets
    # a chunk per token whose text is complete: random byte-level tokens may hold text back a step
    assert all(0 <= len(itl) <= 5 for itl in result["itls"])
    assert result["mean_tpot_ms"] > 0 and result["p99_e2el_ms"] >= result["median_e2el_ms"]
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_with_jsonl_text_prompts_counts_what_the_server_counted(server, server_model, tmp_path):  # noqa: F811
    workload = tmp_path / "prompts.jsonl"
    workload.write_text("\n".join(json.dumps({"prompt": p}) for p in
                                  ["The quick brown fox", "Paris is the capital of", "人工智能正在改变世界。"]))
    before = token_counters(server)
    # no --model: the name comes from /v1/models; the tokenizer from --tokenizer
    proc = bench("--base-url", server.url, "--tokenizer", str(server_model), "--endpoint", "/v1/chat/completions",
                 "--dataset", str(workload), "--num-prompts", "4", "--output-len", "5", "--save-result",
                 "--result-dir", str(tmp_path), "--result-filename", "chat.json", "--no-server-timeline")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "chat.json").read_text())
    assert "server_timeline" not in result and "Server timeline" not in proc.stdout  # /metrics not read
    assert result["model_id"] == SERVED and (result["completed"], result["failed"]) == (4, 0)
    assert all(1 <= n <= 5 for n in result["output_lens"])  # may stop at EOS: no --ignore-eos
    expected = (result["total_input_tokens"], result["total_output_tokens"])
    assert counters_after(server, before, expected) == expected


def test_unknown_model_name_fails_every_request_with_the_servers_message(server, server_model, tmp_path):  # noqa: F811
    proc = bench("--base-url", server.url, "--model", str(server_model), "--served-model-name", "no-such-model",
                 "--input-len", "4", "--output-len", "2", "--num-prompts", "2")
    assert proc.returncode == 1
    assert "Failed requests:                        2" in proc.stdout
    assert "HTTP 404" in proc.stdout and "does not exist" in proc.stdout


def test_save_result_without_matplotlib_keeps_the_json_and_says_how_to_get_the_png(tmp_path, monkeypatch, capsys):
    """matplotlib is the optional `bench` extra: without it the result is still saved."""
    import argparse

    from tengyun.entrypoints.bench.serve import save_result
    from tengyun.ops.bench import RequestResult

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    args = argparse.Namespace(result_filename="run.json", result_dir=str(tmp_path), request_rate=float("inf"),
                              max_concurrency=1, endpoint="/v1/completions", base_url="http://x", dataset="random",
                              num_prompts=1, input_len=4, output_len=2, prefix_len=0, ignore_eos=True)
    results = [RequestResult(True, prompt_len=4, output_len=2, ttft=0.1, latency=0.2, itl=[0.1])]
    path = save_result(args, "model", {"completed": 1}, results, {})
    assert json.loads(path.read_text())["completed"] == 1 and not (tmp_path / "run.png").exists()
    out = capsys.readouterr().out
    assert "no PNG of it" in out and "pip install 'tengyun[bench]'" in out
