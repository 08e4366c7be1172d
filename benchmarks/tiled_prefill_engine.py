"""The tiled bfloat16 prefill attention kernel in the engine: one real model in bfloat16, the kernel on
(the default where it runs) and off (cpu_paged's routing before it: the paged kernel up to 1,024
tokens, torch's SDPA above), in one process, alternating:

- greedy tokens of prompts cut from this repository's own text (its Python sources), 64 to 2,000
  tokens long, and how many continuations are identical with the kernel on and off;
- time to first token of one prompt of each length alone (the engine's prefill steps; median of
  --repeats), at the server's 512-token step budget unless --max-num-batched-tokens says otherwise;
- with --schedule-rounds N: the served sweep's concurrency-64 schedule offline (256 prompts of 128
  random token ids, 128 generated with ignore_eos, at most 64 running, 512-token steps), output
  tok/s with the kernel on and off, alternating, N rounds each.

    OMP_NUM_THREADS=2 python benchmarks/tiled_prefill_engine.py --model smollm2
    OMP_NUM_THREADS=2 python benchmarks/tiled_prefill_engine.py --model qwen2.5-coder --lengths 512,2000
    OMP_NUM_THREADS=2 python benchmarks/tiled_prefill_engine.py --model smollm2 --schedule-rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from pathlib import Path

from tengyun import LLM, SamplingParams
from tengyun.models.model_source import resolve_model
from tengyun.platforms.cpu.kernels import attention

MODELS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "qwen2.5-coder": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}


@contextlib.contextmanager
def tiled(on: bool):
    """The tiled kernel on (as shipped) or off (no head dim qualifies)."""
    kept = attention.TILED_MAX_HEAD_DIM
    attention.TILED_MAX_HEAD_DIM = kept if on else 0
    try:
        yield
    finally:
        attention.TILED_MAX_HEAD_DIM = kept


def prompts_of(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Consecutive slices of the repository's Python sources, one per length, as token ids."""
    text = "\n".join(p.read_text() for p in sorted(Path(__file__).parents[1].glob("tengyun/**/*.py")))
    ids = tokenizer.encode(text)
    out, start = [], 0
    for n in lengths:
        out.append(ids[start:start + n])
        start += n
    return out


def schedule_rounds(llm: LLM, rounds: int) -> None:
    """The concurrency-64 schedule offline, the kernel on and off in turn."""
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(128)]} for _ in range(256)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llm.generate(prompts[:4], params)
    rates: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for on in (True, False):
            with tiled(on):
                start = time.perf_counter()
                outputs = llm.generate(prompts, params)
                seconds = time.perf_counter() - start
            rates[on].append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
            print(f"tiled {'on ' if on else 'off'}: {rates[on][-1]:.1f} output tok/s ({seconds:.1f} s)", flush=True)
    print(f"median: on {statistics.median(rates[True]):.1f}, off {statistics.median(rates[False]):.1f} output tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--lengths", default="64,128,256,512,1000,2000", help="prompt tokens, comma-separated")
    parser.add_argument("--greedy-prompts", type=int, default=4, help="prompts of each length for the greedy check")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--schedule-rounds", type=int, default=0, help="rounds of the concurrency-64 schedule")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    folder = str(resolve_model(MODELS[args.model], "auto").folder)
    llm = LLM(folder, dtype="bfloat16", kv_cache_memory="1GiB", max_model_len=max(lengths) + args.max_tokens + 16,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False, max_num_seqs=64)
    if args.schedule_rounds:
        return schedule_rounds(llm, args.schedule_rounds)
    tokenizer = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts_of(tokenizer, lengths * args.greedy_prompts)]
    tokens = {}
    for on in (True, False):
        with tiled(on):
            tokens[on] = [o.outputs[0].token_ids for o in llm.generate(batch, greedy)]
    same = sum(a == b for a, b in zip(tokens[True], tokens[False]))
    print(f"{MODELS[args.model]}, bfloat16: {same} of {len(batch)} greedy continuations ({args.max_tokens} tokens) "
          f"identical with the tiled kernel on and off")
    first = SamplingParams(temperature=0.0, max_tokens=1)
    print("\n| prompt tokens | TTFT ms tiled on | TTFT ms off | speed-up |\n|---|---|---|---|")
    for prompt in prompts_of(tokenizer, lengths):
        times = {True: [], False: []}
        for _ in range(args.repeats):
            for on in (True, False):
                with tiled(on):
                    start = time.perf_counter()
                    llm.generate([{"prompt_token_ids": prompt}], first, use_tqdm=False)
                    times[on].append(time.perf_counter() - start)
        on_ms, off_ms = (1e3 * statistics.median(times[k]) for k in (True, False))
        print(f"| {len(prompt)} | {on_ms:.1f} | {off_ms:.1f} | {off_ms / on_ms:.2f}x |")


if __name__ == "__main__":
    main()
