"""`tengyun bench throughput` offline on a tiny random Llama: token totals, and the shared-prefix
workload with prefix caching on vs off."""

from __future__ import annotations

import json

from tengyun.entrypoints.cli.main import main


def run_bench(tmp_path, model, *flags: str) -> dict:
    out = tmp_path / "result.json"
    argv = ["bench", "throughput", str(model), "--kv-cache-memory", "32MiB", "--max-model-len", "256",
            "--disable-tqdm", "--output-json", str(out), *flags]
    assert main(argv) == 0
    return json.loads(out.read_text())["runs"]


def test_random_workload_generates_exactly_the_requested_tokens(tmp_path, tiny_checkpoints, capsys):
    runs = run_bench(tmp_path, tiny_checkpoints["llama"], "--num-prompts", "6", "--input-len", "20",
                     "--output-len", "5")
    (result,) = runs.values()
    assert (result["completed"], result["total_input_tokens"], result["total_output_tokens"]) == (6, 120, 30)
    assert result["output_throughput"] == 30 / result["duration"]
    assert "Throughput: " in capsys.readouterr().out


def test_shared_prefix_is_served_from_the_cache_only_with_prefix_caching_on(tmp_path, tiny_checkpoints, capsys):
    runs = run_bench(tmp_path, tiny_checkpoints["qwen2"], "--dataset", "shared-prefix", "--prefix-len", "128",
                     "--num-prompts", "4", "--input-len", "16", "--output-len", "3", "--compare-prefix-caching")
    on, off = runs["prefix caching on"], runs["prefix caching off"]
    assert on["total_input_tokens"] == off["total_input_tokens"] == 4 * (128 + 16)
    # the warm-up request cached the 8 full blocks of the prefix: 128 of each 144-token prompt hit
    assert on["prefix_cache_hit_rate"] == 128 / 144
    assert off["prefix_cache_hit_rate"] == 0.0
    assert "TTFT mean, prefix caching off / on:" in capsys.readouterr().out


def test_jsonl_workload_takes_prompts_and_output_lengths_from_the_file(tmp_path, tiny_checkpoints):
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"prompt_token_ids": [5, 6, 7, 8], "output_len": 3}\n{"prompt": "The quick brown fox"}\n')
    for flags in (["--dataset", str(workload)], ["--dataset-name", "custom", "--dataset-path", str(workload)]):
        runs = run_bench(tmp_path, tiny_checkpoints["llama"], *flags, "--num-prompts", "4", "--output-len", "2")
        (result,) = runs.values()
        assert result["completed"] == 4
        assert result["total_output_tokens"] == 3 + 2 + 3 + 2  # rows repeat; "output_len" beats --output-len
