"""Two OpenMP pools throttle each other: work done in a second thread after the first thread ran
a parallel op (and so owns a libgomp pool) waits at barriers with 100 spins instead of ~300,000
while the pools hold more threads than there are cores. Modes:

    same    the work in the thread that made the pool (offline LLM.generate)
    other   the work in a second thread while the first keeps its pool
    loader  the pool made in a thread that exits first (`tengyun serve` loads in one)
    pause   the first thread frees its pool (omp_pause_resource_all) before the second works
    engine  LLM built in the main thread, generate() in a second one (add --keep-pool to skip
            the release the CPU platform does after building)

    python benchmarks/openmp_pools.py same other loader pause
    OMP_NUM_THREADS=2 python benchmarks/openmp_pools.py engine    # 2 threads, fixed: no tuning
    OMP_NUM_THREADS=2 python benchmarks/openmp_pools.py engine --keep-pool
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import threading
import time


def micro(mode: str) -> list[float]:
    """Seconds for 2,000 x (SiLU * x, then [64 x 576] @ [576 x 1536]), three times."""
    import torch

    from tengyun.platforms.cpu.runtime.threads import release_openmp_pool

    x, w = torch.randn(64, 576), torch.randn(576, 1536)

    def work(n: int = 2000) -> float:
        started = time.perf_counter()
        for _ in range(n):
            torch.nn.functional.silu(x).mul(x) @ w
        return time.perf_counter() - started

    if mode == "loader":
        in_thread(lambda: work(50))
    else:
        work(50)  # this thread's pool, as loading a model makes
    if mode == "pause":
        release_openmp_pool()
    if mode == "same":
        return [work() for _ in range(3)]
    return in_thread(lambda: [work() for _ in range(3)])


def engine(keep_pool: bool) -> float:
    """Output tok/s of SmolLM2, 64 prompts x 128 random tokens in, 64 out, generated in a second thread."""
    import tengyun.platforms.cpu.runtime.threads as cpu_threads
    from tengyun import LLM, SamplingParams
    from tengyun.models.model_source import resolve_model

    if keep_pool:  # CpuPlatform.step_threads imports it from cpu_threads when it runs
        cpu_threads.release_openmp_pool = lambda: False
    folder = str(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", "auto").folder)
    llm = LLM(folder, kv_cache_memory="1GiB", max_model_len=512)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(128)]} for _ in range(64)]

    def run() -> float:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        started = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True, temperature=1.0))
        return 64 * 64 / (time.perf_counter() - started)

    return in_thread(run)


def in_thread(fn):
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modes", nargs="+", choices=("same", "other", "loader", "pause", "engine"))
    parser.add_argument("--keep-pool", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        (mode,) = args.modes
        result = engine(args.keep_pool) if mode == "engine" else micro(mode)
        print(f"{mode}{' --keep-pool' * args.keep_pool}: "
              + (f"{result:.1f} tok/s" if mode == "engine" else " ".join(f"{s:.3f}" for s in result) + " s"))
        return
    for mode in args.modes:  # each in a fresh process: pools outlive the work
        cmd = [sys.executable, __file__, mode, "--child"] + ["--keep-pool"] * args.keep_pool
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
