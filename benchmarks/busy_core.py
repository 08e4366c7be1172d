"""Tengyun's offline throughput on a quiet machine and with one core busy, per thread setting.

"Busy" runs `taskset -c CORE python -c "while 1: pass"` for the length of the run. Settings
are environments for the measured process (`default` = the engine's own choice, nothing
set); quiet and busy runs of every setting alternate within each repeat, so drift in the
machine's other load hits all of them. Each run is `offline_throughput.py --child --system
tengyun` (its own process). "other" is the CPU, in cores, that processes other than the
measured one and the spinner took during the run (the machine is shared; above ~0.1 the run
was disturbed). Prints one row per run, then medians:

    python benchmarks/busy_core.py --num-prompts 32 --output-len 64 --repeats 3 \\
        --setting default --setting omp1=OMP_NUM_THREADS=1 --setting passive=OMP_WAIT_POLICY=PASSIVE
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from offline_throughput import MODELS, write_workload  # noqa: E402

SPIN = "while 1: pass"


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat's first line)."""
    user, nice, system, idle, iowait, irq, softirq, steal = map(int, open("/proc/stat").readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    usage = os.times()
    return usage.children_user + usage.children_system


def parse_setting(text: str) -> tuple[str, dict[str, str]]:
    """"omp1=OMP_NUM_THREADS=1,OMP_PROC_BIND=true" -> ("omp1", {...}); "default" -> ("default", {})."""
    name, _, rest = text.partition("=")
    env = dict(pair.split("=", 1) for pair in rest.split(",") if pair)
    return name, env


def run_once(args, folder: str, workload: str, env: dict[str, str], busy: bool) -> dict:
    """One measured child run; returns its RESULT plus load average and other processes' cores."""
    spinner = subprocess.Popen(["taskset", "-c", str(args.busy_core), sys.executable, "-c", SPIN]) if busy else None
    load_before = open("/proc/loadavg").read().split()[:3]
    busy_before, ours_before, wall_before = machine_busy_s(), children_cpu_s(), time.monotonic()
    cmd = [sys.executable, os.path.join(HERE, "offline_throughput.py"), "--child", "--system", "tengyun",
           "--folder", folder, "--workload", workload, "--max-model-len", str(args.max_model_len),
           "--dtype", args.dtype]
    full_env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    try:
        proc = subprocess.run(cmd, env={**full_env, **env}, capture_output=True, text=True)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    wall = time.monotonic() - wall_before
    other = (machine_busy_s() - busy_before) - (children_cpu_s() - ours_before)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"run failed:\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][7:])
    choices = [line for line in proc.stderr.splitlines() if "thread" in line.lower() and "OpenMP" in line]
    return {"tok_s": result["output_tokens"] / result["elapsed_s"], "load": " ".join(load_before),
            "other_cores": max(other, 0.0) / wall, "choice": choices[-1][-120:] if choices else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--busy-core", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"),
                        help="Tengyun's --dtype (auto: its default, bfloat16 on cores with native bf16)")
    parser.add_argument("--setting", action="append", default=[],
                        help="NAME or NAME=VAR=VALUE[,VAR=VALUE]; repeatable (default: just 'default')")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from tengyun.models.model_source import resolve_model

    settings = [parse_setting(s) for s in args.setting or ["default"]]
    folder = str(resolve_model(MODELS[args.model], "auto").folder)
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workload = os.path.join(tmp, "workload.jsonl")
        write_workload(workload, folder, args.num_prompts, args.input_len, args.output_len)
        for repeat in range(args.repeats):
            order = [(name, env, busy) for name, env in settings for busy in (False, True)]
            for name, env, busy in order if repeat % 2 == 0 else reversed(order):
                run = run_once(args, folder, workload, env, busy)
                runs.setdefault((name, "busy" if busy else "quiet"), []).append(run)
                print(f"{name:>12} {'busy' if busy else 'quiet':>5} {run['tok_s']:7.1f} tok/s  other "
                      f"{run['other_cores']:.2f} cores  load {run['load']}  {run['choice']}", flush=True)
    print(f"\nmodel={args.model} prompts={args.num_prompts} in={args.input_len} out={args.output_len} "
          f"repeats={args.repeats}, median output tok/s (min-max)")
    print("| setting | quiet | one core busy | busy / quiet |\n|---|---|---|---|")
    for name, _ in settings:
        rates = {c: [r["tok_s"] for r in runs[(name, c)]] for c in ("quiet", "busy")}
        med = {c: statistics.median(v) for c, v in rates.items()}
        cells = [f"{med[c]:.1f} ({min(rates[c]):.0f}-{max(rates[c]):.0f})" for c in ("quiet", "busy")]
        print(f"| {name} | {cells[0]} | {cells[1]} | {med['busy'] / med['quiet']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": {f"{k[0]}/{k[1]}": v for k, v in runs.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
