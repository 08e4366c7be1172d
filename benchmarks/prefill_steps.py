"""Prefill and decode step times of one engine, three rounds of N requests, with and without the
CPU allocator setting applied after loading (CpuPlatform.after_load: no new mmaps).

    PYTHONPATH=$PWD OMP_NUM_THREADS=2 python benchmarks/prefill_steps.py --model qwen2.5-coder
    PYTHONPATH=$PWD OMP_NUM_THREADS=2 python benchmarks/prefill_steps.py --model qwen2.5-coder --keep-mmap

Each round adds N requests of 128 random token ids (60 output tokens, temperature 1.0) at once:
the first step prefills all of them (N x 128 tokens <= the 2048-token step budget), the rest
decode. Prints the prefill step, the median decode step and the process's resident memory.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tengyun import LLM, SamplingParams

MODELS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "qwen2.5-coder": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}


def rss_mib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-coder")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep-mmap", action="store_true", help="skip CpuPlatform.after_load (glibc's mmaps stay)")
    args = parser.parse_args()
    if args.keep_mmap:
        from tengyun.platforms.cpu.platform import CpuPlatform

        CpuPlatform.after_load = lambda self: None
    from tengyun.models.model_source import resolve_model

    folder = str(resolve_model(MODELS[args.model], "auto").folder)
    engine = LLM(folder, max_model_len=512, kv_cache_memory="1GiB", dtype=args.dtype).llm_engine
    rng = random.Random(0)
    for round_ in range(args.rounds):
        for i in range(args.num_prompts):
            engine.add_request(f"{round_}-{i}", [rng.randrange(1000, 20000) for _ in range(128)],
                               SamplingParams(max_tokens=60, temperature=1.0, ignore_eos=True))
        started = time.perf_counter()
        engine.step()
        prefill = time.perf_counter() - started
        decode = []
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            decode.append(time.perf_counter() - started)
        print(f"round {round_ + 1}: prefill of {args.num_prompts} x 128 tokens {prefill:.2f} s, decode step median "
              f"{statistics.median(decode) * 1e3:.1f} ms, RSS {rss_mib()} MiB", flush=True)


if __name__ == "__main__":
    main()
