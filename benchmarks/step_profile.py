"""Time one engine's prefill and decode steps, optionally with the torch profiler's top ops.

Default: 64 requests of 128 random tokens on the embedded SmolLM2: 4 prefill steps (2048 tokens
each), then decode steps of 64 sequences. ``--batch 1 --model smollm2 --dtype bfloat16``: one
request on the real SmolLM2-135M-Instruct (the HF folder Tengyun converts from the PyPI GGUF),
and where a decode step's time goes: the model's forward, the LM head, sampling and the rest of
the engine step (scheduler, input preparation, outputs), as medians over the decode steps.

    python benchmarks/step_profile.py [--profile]
    OMP_NUM_THREADS=2 python benchmarks/step_profile.py --batch 1 --model smollm2 --dtype bfloat16 --profile
    OMP_NUM_THREADS=2 python benchmarks/step_profile.py --batch 1 --folder ~/.cache/tengyun/quantized/smollm2-w8a8
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time

from tengyun import LLM, SamplingParams

MODELS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "qwen2.5-coder": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}


def build_engine(args):
    if args.folder:  # e.g. a `tengyun quantize` folder, or a GGUF file with --quantization gguf
        return LLM(args.folder, max_model_len=512, kv_cache_memory="1GiB", dtype=args.dtype,
                   block_size=args.block_size, quantization=args.quantization).llm_engine
    if args.model == "embedded":
        return LLM(max_model_len=300, kv_cache_memory="1GiB", dtype=args.dtype, block_size=args.block_size).llm_engine
    from tengyun.models.model_source import resolve_model

    folder = str(resolve_model(MODELS[args.model], "auto").folder)
    return LLM(folder, max_model_len=512, kv_cache_memory="1GiB", dtype=args.dtype,
               block_size=args.block_size).llm_engine


def timed(obj, name: str, into: dict[str, list[float]]) -> None:
    """Wrap obj.name to append each call's wall seconds to into[name]."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            into.setdefault(name, []).append(time.perf_counter() - start)

    setattr(obj, name, wrapper)


@contextlib.contextmanager
def profiled(enabled: bool):
    """Under the torch profiler when enabled: print its top ops by self CPU time at the end."""
    if not enabled:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true", help="print the top ops of 3 decode steps")
    parser.add_argument("--profile-prefill", action="store_true", help="print the top ops of the prefill steps")
    parser.add_argument("--decode-steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="requests, all at once")
    parser.add_argument("--model", choices=["embedded", *MODELS], default="embedded")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=None, help="KV block size (default: the platform's)")
    parser.add_argument("--folder", default=None, help="serve this model folder or file instead of --model")
    parser.add_argument("--quantization", default=None, help="as `tengyun serve --quantization` (with --folder)")
    args = parser.parse_args()
    engine = build_engine(args)
    runner = engine.executor.runner
    parts: dict[str, list[float]] = {}
    timed(runner.model, "forward", parts)
    timed(runner.model, "compute_logits", parts)
    timed(runner, "_sample", parts)
    rng = random.Random(0)
    params = SamplingParams(temperature=1.0, max_tokens=128 + args.decode_steps + 8, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), [rng.randrange(100, 40000) for _ in range(128)], params)
    with profiled(args.profile_prefill):
        start, prefill_steps = time.perf_counter(), 0
        scheduler = engine.scheduler
        while scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running):
            engine.step()
            prefill_steps += 1
        print(f"prefill of {args.batch} x 128 tokens: {time.perf_counter() - start:.2f} s ({prefill_steps} steps)")
    for _ in range(3):
        engine.step()
    parts.clear()
    steps = []
    for _ in range(args.decode_steps):
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    step = statistics.median(steps)
    print(f"decode step, {args.batch} sequences: {step * 1e3:.2f} ms (median of {args.decode_steps})")
    named = {name: statistics.median(times) for name, times in parts.items()}
    for name, seconds in named.items():
        print(f"  {name:15s} {seconds * 1e3:7.2f} ms")
    print(f"  {'the rest':15s} {(step - sum(named.values())) * 1e3:7.2f} ms  (scheduler, inputs, outputs)")
    with profiled(args.profile):
        for _ in range(3):
            engine.step()


if __name__ == "__main__":
    main()
