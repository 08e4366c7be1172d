"""`tengyun plan --profile-json`: a running engine's measured step beside the plan's estimate."""

from __future__ import annotations

import json
import subprocess
import sys

from tengyun.entrypoints.llm import LLM

SETTINGS = ["--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--block-size", "16"]


def _plan(*args):
    return subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "plan", *args],
                          capture_output=True, text=True, timeout=120)


def test_plan_compares_its_estimate_with_the_engines_measured_step(tiny_checkpoints, tmp_path):
    folder = str(tiny_checkpoints["llama"])
    llm = LLM(folder, dtype="float32", kv_cache_memory="1MiB", max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=64)
    detail = tmp_path / "detail.json"  # as GET /health/detail answers: {"memory": [one report per rank], ...}
    detail.write_text(json.dumps({"status": "ok", "memory": llm.llm_engine.memory_reports}))
    [rank] = llm.llm_engine.memory_reports
    flags = [folder, "--device", "cuda", "--device-memory", "64MiB", "--dtype", "float32", *SETTINGS]

    text = _plan(*flags, "--profile-json", str(detail))
    assert text.returncode == 0, text.stderr
    assert (f"Profile (rank 0, process resident peak (VmHWM)): one step of 64 tokens took "
            f"{rank['activation_peak'] / 2**20:.1f} MiB (measured)") in text.stdout

    report = json.loads(_plan(*flags, "--profile-json", str(detail), "--json").stdout)
    profile = report["profile"]
    assert profile["activation_used"] == rank["activation_peak"] and profile["weights_measured"] == rank["weights"]
    assert profile["activation_estimate"] == report["activation_bytes"]  # the plan keeps its own estimate
    # With the measured peak reserved instead: the blocks the plan counts with --activation-reserve.
    reserved = json.loads(_plan(*flags, "--activation-reserve", f"{rank['activation_peak']}B", "--json").stdout)
    assert profile["blocks_with_measured_peak"] == reserved["blocks"]


def test_plan_refuses_a_profile_without_rank_reports(tiny_checkpoints, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"status": "ok"}))
    proc = _plan(str(tiny_checkpoints["llama"]), "--device", "cuda", *SETTINGS, "--profile-json", str(bad))
    assert proc.returncode == 2
    assert f"--profile-json {bad}: no rank memory report in it" in proc.stderr
