"""Decode graphs on CPU (tengyun/platforms/cpu/runtime/graphs.py): a small decode step with and without
them, on the real SmolLM2-135M-Instruct, in fresh processes alternated per repeat.

Per run: B requests of 128 token ids, 100 greedy tokens each (ignore_eos); the median over the
decode steps of the step's wall time and of the process's CPU time (``time.process_time``: the
CPU the step cost on every thread, less sensitive to other jobs on a shared machine than wall
time), and the engine's start-up time (graphs are captured during it).

    OMP_NUM_THREADS=1 python benchmarks/decode_graphs.py --dtype bfloat16 --batch 1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def child(args) -> dict:
    from tengyun import LLM, SamplingParams
    from tengyun.models.model_source import resolve_model

    folder = str(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", "auto").folder)
    start = time.perf_counter()
    engine = LLM(folder, max_model_len=512, kv_cache_memory="1GiB", dtype=args.dtype,
                 enforce_eager=args.mode == "eager").llm_engine
    ready = time.perf_counter() - start
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), [(100 + 7 * i + j) % 49000 + 1 for j in range(128)], params)
    engine.step()  # the prefill
    wall, cpu = [], []
    while engine.has_unfinished_requests():
        w, c = time.perf_counter(), time.process_time()
        engine.step()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return {"step_wall_ms": statistics.median(wall) * 1e3, "step_cpu_ms": statistics.median(cpu) * 1e3,
            "ready_s": ready}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", choices=("eager", "graphs"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(child(args)))
        return
    runs: dict[str, list[dict]] = {"eager": [], "graphs": []}
    for _ in range(args.repeats):
        for mode in runs:
            out = subprocess.run([sys.executable, __file__, "--dtype", args.dtype, "--batch", str(args.batch),
                                  "--mode", mode], capture_output=True, text=True, check=True, env=os.environ)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    threads = os.environ.get("OMP_NUM_THREADS", "all")
    print(f"SmolLM2-135M {args.dtype}, batch {args.batch}, OMP_NUM_THREADS={threads}, "
          f"median of {args.repeats} runs (each the median over 99 decode steps), load {os.getloadavg()[0]:.2f}")
    print("| mode | step wall ms | step CPU ms | start-up s |")
    print("|---|---|---|---|")
    for mode, results in runs.items():
        med = {key: statistics.median(r[key] for r in results) for key in results[0]}
        print(f"| {mode} | {med['step_wall_ms']:.2f} | {med['step_cpu_ms']:.2f} | {med['ready_s']:.1f} |")


if __name__ == "__main__":
    main()
