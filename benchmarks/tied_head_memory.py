"""Memory a tied LM head costs on CPU: one copy (the packed head serves the embedding's lookups)
against two (the embedding keeps its plain weight: today's fallback, forced by making
``CpuPackedLinearKernel.row_reader`` answer None), each in a fresh process, interleaved.

    PYTHONPATH=$PWD python benchmarks/tied_head_memory.py [--repeats 2]

Per run: the worker's weight bytes (Worker.weight_bytes, what it logs), RSS after the load (the
process's resident set once the engine is built) and RSS over the load (that minus the RSS before
LLM(...)), then 8 greedy tokens of one prompt, which must be equal across the two modes. Models:
SmolLM2-135M-Instruct in float32 and bfloat16, and its W8A8 folder from `tengyun quantize`
(benchmarks/quant.py's cache: ~/.cache/tengyun/quantized/smollm2-w8a8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

MiB = 2**20
REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, os, sys
mode, model, dtype = sys.argv[1:4]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
import torch
from tengyun import LLM, SamplingParams
from tengyun.platforms.cpu_linear import CpuPackedLinearKernel
if mode == "two":
    CpuPackedLinearKernel.row_reader = lambda *args: None
before = rss()
llm = LLM(model, dtype=dtype, max_model_len=256, kv_cache_memory="64MiB")
after = rss()
worker = llm.llm_engine.executor
out = llm.generate([{"prompt_token_ids": [1, 504, 3458, 282, 4649, 314]}],
                   SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
print(json.dumps({"weight_bytes": worker.weight_bytes, "rss_after_load": after, "rss_over_load": after - before,
                  "served": worker.model.model.embed_tokens.row_reader is not None,
                  "tokens": out[0].outputs[0].token_ids}))
"""


def run(mode: str, model: str, dtype: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, mode, model, dtype], cwd=REPO, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from tengyun.models.model_source import resolve_model

    sys.path.insert(0, str(REPO / "benchmarks"))
    from offline_throughput import MODELS

    smollm2 = resolve_model(MODELS["smollm2"], "auto").folder
    w8a8 = Path.home() / ".cache/tengyun/quantized/smollm2-w8a8"
    cases = [("SmolLM2 float32", smollm2, "float32"), ("SmolLM2 bfloat16", smollm2, "bfloat16"),
             ("SmolLM2 W8A8 (bf16)", str(w8a8), "bfloat16")]
    print("| model | copies | weight bytes MiB | RSS after load MiB | RSS over load MiB | tokens equal |")
    print("|---|---|---|---|---|---|")
    for name, model, dtype in cases:
        runs: dict[str, list[dict]] = {"two": [], "one": []}
        for i in range(args.repeats):
            for mode in (("two", "one") if i % 2 == 0 else ("one", "two")):
                runs[mode].append(run(mode, model, dtype))
        assert all(r["served"] for r in runs["one"]) and not any(r["served"] for r in runs["two"])
        same = all(r["tokens"] == runs["two"][0]["tokens"] for r in runs["one"] + runs["two"])
        for mode in ("two", "one"):
            def median(key, rs=runs[mode]):
                return statistics.median(r[key] for r in rs) / MiB
            print(f"| {name} | {mode} | {median('weight_bytes'):.1f} | {median('rss_after_load'):.0f} | "
                  f"{median('rss_over_load'):.0f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
