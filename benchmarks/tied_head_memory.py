"""Memory a tied LM head costs on CPU: one copy (the packed head serves the embedding's lookups)
against two (the embedding keeps its plain weight: today's fallback, forced by making
``CpuPackedLinearKernel.row_reader`` answer None), each in a fresh process, interleaved.

    PYTHONPATH=$PWD python benchmarks/tied_head_memory.py [--repeats 2]
    PYTHONPATH=$PWD python benchmarks/tied_head_memory.py --lookups   # the lookup's cost instead

Per run: the worker's weight bytes (Worker.weight_bytes, what it logs), RSS after the load (the
process's resident set once the engine is built), RSS over the load (that minus the RSS before
LLM(...)) and the same after gc + malloc_trim(0) (the engine keeps freed heap memory for reuse,
M_TRIM_THRESHOLD 1 GiB, so the untrimmed figure varies with what the load freed), then 8 greedy
tokens of one prompt, which must be equal across the two modes; the packed size is
benchmarks/quant.py's (safetensors, float tensors in the served dtype). --lookups times T random
ids through F.embedding on the plain [49152, 576] weight and packed_rows on its packed copy,
interleaved in one process (median of 7, microseconds a call). Models:
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
import ctypes, gc, json, os, sys
mode, model, dtype = sys.argv[1:4]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
import torch
from tengyun import LLM, SamplingParams
from tengyun.platforms.cpu.kernels.linear import CpuPackedLinearKernel
if mode == "two":
    CpuPackedLinearKernel.row_reader = lambda *args: None
before = rss()
llm = LLM(model, dtype=dtype, max_model_len=256, kv_cache_memory="64MiB")
after = rss()
gc.collect()
ctypes.CDLL(None).malloc_trim(0)
trimmed = rss()
worker = llm.llm_engine.executor
out = llm.generate([{"prompt_token_ids": [1, 504, 3458, 282, 4649, 314]}],
                   SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
print(json.dumps({"weight_bytes": worker.weight_bytes, "rss_after_load": after, "rss_over_load": after - before,
                  "trimmed_over_load": trimmed - before,
                  "served": worker.model.model.embed_tokens.row_reader is not None,
                  "tokens": out[0].outputs[0].token_ids}))
"""


def run(mode: str, model: str, dtype: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, mode, model, dtype], cwd=REPO, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def lookups() -> None:
    import time

    import torch
    import torch.nn.functional as F

    from tengyun.platforms.cpu import native as cpu_kernels
    from tengyun.platforms.cpu.kernels.linear import CpuPackedLinearKernel

    assert cpu_kernels.load_error() is None, cpu_kernels.load_error()
    print("| dtype | T | F.embedding us | packed_rows us |")
    print("|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(49152, 576).to(dtype)
        kernel = CpuPackedLinearKernel(dtype)
        read = kernel.row_reader(kernel.prepare(weight), weight)
        for count in (1, 32, 4096):
            ids = torch.randint(0, 49152, (count,))
            calls = {"F.embedding": lambda ids=ids, weight=weight: F.embedding(ids, weight),
                     "packed_rows": lambda ids=ids, read=read: read(ids)}
            times: dict[str, list[float]] = {name: [] for name in calls}
            loops = 2000 if count < 4096 else 20
            for rep in range(7):
                for name in sorted(calls, reverse=rep % 2 == 1):
                    start = time.perf_counter()
                    for _ in range(loops):
                        calls[name]()
                    times[name].append((time.perf_counter() - start) / loops * 1e6)
            print(f"| {str(dtype)[6:]} | {count} | {statistics.median(times['F.embedding']):.1f} | "
                  f"{statistics.median(times['packed_rows']):.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--lookups", action="store_true", help="time the lookups instead")
    args = parser.parse_args()
    if args.lookups:
        return lookups()
    from tengyun.models.model_source import resolve_model

    sys.path.insert(0, str(REPO / "benchmarks"))
    from offline_throughput import MODELS
    from quant import packed_bytes

    smollm2 = resolve_model(MODELS["smollm2"], "auto").folder
    w8a8 = Path.home() / ".cache/tengyun/quantized/smollm2-w8a8"
    cases = [("SmolLM2 float32", smollm2, "float32"), ("SmolLM2 bfloat16", smollm2, "bfloat16"),
             ("SmolLM2 W8A8 (bf16)", str(w8a8), "bfloat16")]
    print("| model | copies | weight bytes MiB | packed MiB | held / packed | RSS after load MiB | "
          "RSS over load MiB | trimmed RSS over load MiB | tokens equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, model, dtype in cases:
        runs: dict[str, list[dict]] = {"two": [], "one": []}
        for i in range(args.repeats):
            for mode in (("two", "one") if i % 2 == 0 else ("one", "two")):
                runs[mode].append(run(mode, model, dtype))
        assert all(r["served"] for r in runs["one"]) and not any(r["served"] for r in runs["two"])
        same = all(r["tokens"] == runs["two"][0]["tokens"] for r in runs["one"] + runs["two"])
        packed = packed_bytes(Path(model), dtype) / MiB
        for mode in ("two", "one"):
            def median(key, rs=runs[mode]):
                return statistics.median(r[key] for r in rs) / MiB
            print(f"| {name} | {mode} | {median('weight_bytes'):.1f} | {packed:.1f} | "
                  f"{median('weight_bytes') / packed:.2f} | {median('rss_after_load'):.0f} | "
                  f"{median('rss_over_load'):.0f} | {median('trimmed_over_load'):.0f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
