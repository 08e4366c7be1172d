"""Offline throughput: Tengyun's LLM.generate vs HF transformers' generate, same model, same
workload (N random-token prompts x INPUT_LEN in, OUTPUT_LEN out, ignore_eos, fp32,
temperature 1.0 as `vllm bench throughput` samples).

Each run is its own subprocess (clean peak RSS); systems alternate per repeat so machine
drift hits both. Prints a table; --json writes the raw numbers.

    python benchmarks/offline_throughput.py --model smollm2 --threads 2 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MODELS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "qwen2.5-coder": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}


def _prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(num)]


def _percentiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"mean": statistics.fmean(values), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def run_tengyun(args) -> dict:
    from tengyun import LLM, SamplingParams

    llm = LLM(MODELS[args.model], max_model_len=args.input_len + args.output_len + 16,
              kv_cache_memory=args.kv_cache_memory)
    prompts = _prompts(args.num_prompts, args.input_len, llm.llm_engine.vocab_size)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.output_len, ignore_eos=True, seed=None)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    tpot = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in outputs]
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"elapsed_s": elapsed, "output_tokens": generated, "ttft_s": _percentiles(ttft),
            "tpot_s": _percentiles(tpot)}


def run_hf(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from tengyun.models.model_source import resolve_model

    source = resolve_model(MODELS[args.model], "auto")
    model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32).eval()
    prompts = _prompts(args.num_prompts, args.input_len, model.config.vocab_size)
    batch = args.hf_batch_size or args.num_prompts
    kwargs = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                  max_new_tokens=args.output_len, min_new_tokens=args.output_len, pad_token_id=0)
    with torch.no_grad():
        model.generate(torch.tensor(prompts[:2]), **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        start = time.perf_counter()
        generated = 0
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i:i + batch])  # equal lengths: no padding needed
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            generated += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "output_tokens": generated}


def child(args) -> None:
    result = (run_tengyun if args.system == "tengyun" else run_hf)(args)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)


def parent(args) -> None:
    systems = ["tengyun", "hf"] if args.systems == "both" else [args.systems]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    results: dict[str, list[dict]] = {s: [] for s in systems}
    for repeat in range(args.repeats):
        for system in systems if repeat % 2 == 0 else reversed(systems):
            cmd = [sys.executable, __file__, "--child", "--system", system] + _forward(args)
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if proc.returncode or not lines:
                sys.exit(f"{system} run failed:\n{proc.stderr[-3000:]}")
            results[system].append(json.loads(lines[-1][7:]))
            print(f"[{system} run {repeat + 1}] {results[system][-1]}", file=sys.stderr, flush=True)
    _print_table(args, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


def _print_table(args, results) -> None:
    print(f"\nmodel={args.model} prompts={args.num_prompts} in={args.input_len} out={args.output_len} "
          f"fp32 OMP_NUM_THREADS={args.threads} repeats={args.repeats}")
    print("| system | output tok/s | total tok/s | wall s | TTFT mean / p99 s | TPOT mean / p99 ms | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    rates = {}
    for system, runs in results.items():
        best = min(runs, key=lambda r: r["elapsed_s"])
        rates[system] = best["output_tokens"] / best["elapsed_s"]
        total = rates[system] * (args.input_len + args.output_len) / args.output_len
        ttft = f"{best['ttft_s']['mean']:.2f} / {best['ttft_s']['p99']:.2f}" if "ttft_s" in best else "-"
        tpot = (f"{best['tpot_s']['mean'] * 1e3:.0f} / {best['tpot_s']['p99'] * 1e3:.0f}"
                if "tpot_s" in best else "-")
        print(f"| {system} | {rates[system]:.1f} | {total:.1f} | {best['elapsed_s']:.1f} | {ttft} | {tpot} | "
              f"{max(r['peak_rss_mib'] for r in runs):.0f} |")
    if "tengyun" in rates and "hf" in rates:
        print(f"\nTengyun / HF output throughput: {rates['tengyun'] / rates['hf']:.2f}x")


def _forward(args) -> list[str]:
    return ["--model", args.model, "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--kv-cache-memory", args.kv_cache_memory,
            "--hf-batch-size", str(args.hf_batch_size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--systems", choices=["both", "tengyun", "hf"], default="both")
    parser.add_argument("--hf-batch-size", type=int, default=0, help="0 = all prompts in one batch")
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    child(args) if args.child else parent(args)


if __name__ == "__main__":
    main()
