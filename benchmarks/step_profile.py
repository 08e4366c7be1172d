"""Time one engine's prefill and decode steps, optionally with the torch profiler's top ops.

64 requests of 128 random tokens on the embedded SmolLM2: 4 prefill steps (2048 tokens
each), then decode steps of 64 sequences.

    python benchmarks/step_profile.py [--profile]
"""

from __future__ import annotations

import argparse
import random
import time

from tengyun import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true", help="print the top ops of 3 decode steps")
    parser.add_argument("--decode-steps", type=int, default=20)
    args = parser.parse_args()
    engine = LLM(max_model_len=300, kv_cache_memory="1GiB").llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True)
    for i in range(64):
        engine.add_request(str(i), [rng.randrange(100, 40000) for _ in range(128)], params)
    start = time.perf_counter()
    for _ in range(4):
        engine.step()
    print(f"prefill of 64 x 128 tokens: {time.perf_counter() - start:.2f} s")
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    for _ in range(args.decode_steps):
        engine.step()
    print(f"decode step, 64 sequences: {(time.perf_counter() - start) / args.decode_steps * 1e3:.0f} ms")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
