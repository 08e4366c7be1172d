"""The served workload on the engine alone: N requests of 128 random token ids (128 output tokens,
greedy, ignore_eos), C in flight at a time, a finished one replaced at once, as `vllm bench serve
--max-concurrency C` drives a server but without the HTTP server, the API process or the client
on the same cores. Prints output tok/s, steps and the median step.

    OMP_NUM_THREADS=2 PYTHONPATH=$PWD python benchmarks/closed_loop.py --concurrency 64
    OMP_NUM_THREADS=2 PYTHONPATH=$PWD python benchmarks/closed_loop.py --concurrency 16 --amx-tile-rows 0
    LD_PRELOAD=libtcmalloc_minimal.so.4 OMP_NUM_THREADS=2 PYTHONPATH=$PWD python benchmarks/closed_loop.py

The gap between this and a served run of the same workload is what serving costs.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from tengyun import LLM, SamplingParams

MODELS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "qwen2.5-coder": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="512: `tengyun serve`'s CPU default")
    parser.add_argument("--amx-tile-rows", type=int, default=None,
                        help="rows the AMX tile kernel takes (cpu/kernels/linear.py AMX_TILE_ROWS; 0: off, so oneDNN "
                             "runs 5+ rows and decode graphs stop at the small-batch kernel's 4); default: the "
                             "engine's")
    args = parser.parse_args()
    from tengyun.models.model_source import resolve_model

    if args.amx_tile_rows is not None:
        from tengyun.platforms.cpu.kernels import linear

        linear.AMX_TILE_ROWS = args.amx_tile_rows

    folder = str(resolve_model(MODELS[args.model], "auto").folder)
    engine = LLM(folder, max_model_len=args.input_len + args.output_len + 16, kv_cache_memory="2GiB",
                 dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens).llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    def add(request_id: str) -> None:
        engine.add_request(request_id, [rng.randrange(100, 40000) for _ in range(args.input_len)], params)

    add("warm-up")
    while engine.has_unfinished_requests():
        engine.step()
    sent = 0
    for _ in range(min(args.concurrency, args.num_prompts)):
        add(str(sent))
        sent += 1
    steps: list[float] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - step_start)
        for output in outputs:
            if output.finished and sent < args.num_prompts:
                add(str(sent))
                sent += 1
    total = time.perf_counter() - start
    print("| model | concurrency | budget | LD_PRELOAD | AMX tile rows | output tok/s | steps | median step ms |")
    print("|---|---|---|---|---|---|---|---|")
    preload = os.environ.get("LD_PRELOAD") or "-"
    tiles = "default" if args.amx_tile_rows is None else args.amx_tile_rows
    print(f"| {args.model} | {args.concurrency} | {args.max_num_batched_tokens} | {preload} | {tiles} | "
          f"{args.num_prompts * args.output_len / total:.1f} | {len(steps)} | {statistics.median(steps) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
