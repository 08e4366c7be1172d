"""The small-batch kernel's row limit in the engine: engine steps that run a 128-token prompt, timed
with the CPU linear kernel's ``max_small_rows`` at each given limit, the limits taking turns step by
step in one process (a shared VM's speed drifts within seconds).

Two kinds of step, on the real model folder (platforms/cpu/kernels/linear.py, MAX_SMALL_ROWS):
- ``alone``: one 128-token prompt and nothing else running: the prefill step behind a request's
  first token at concurrency 1 (128 rows through every projection);
- ``beside N``: one 128-token prompt joining N decoding sequences, the step a served run at
  concurrency N + 1 takes each time a request finishes and the next arrives (128 + N rows).
Each timed prompt is new random tokens (no prefix-cache hit) and is aborted after its step.

    OMP_NUM_THREADS=2 python benchmarks/small_rows_steps.py --model qwen2.5-coder --limits 64,512
"""

from __future__ import annotations

import argparse
import itertools
import random
import time

from tengyun import SamplingParams

from linear_kernels import _alternated
from step_profile import build_engine

PROMPT_TOKENS = 128


def _timed_prompt_step(engine, rng: random.Random, request_id: str) -> float:
    """Add one new 128-token prompt, time the engine step that prefills it, abort it -> ms."""
    prompt = [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    engine.step()
    elapsed = (time.perf_counter() - start) * 1e3
    engine.abort_request(request_id)
    return elapsed


def _alternate(engine, kernel, limits: list[int], rounds: int, rng: random.Random, tag: str) -> dict[int, float]:
    """Median ms of a prompt step at each limit, the limits taking turns for ``rounds`` rounds after
    one untimed round that warms each limit's path."""
    steps = itertools.count()

    def step_at(limit: int) -> float:
        kernel.max_small_rows = limit
        return _timed_prompt_step(engine, rng, f"{tag}-{next(steps)}-{limit}")

    return _alternated(step_at, tuple(limits), rounds, warmup_rounds=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["smollm2", "qwen2.5-coder"], default="qwen2.5-coder")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--limits", default="64,512", help="comma-separated max_small_rows values")
    parser.add_argument("--beside", type=int, default=63, help="decoding sequences beside the prompt")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    args.folder = args.quantization = args.block_size = None
    engine = build_engine(args)
    kernel = engine.executor.kernels.linear
    if not hasattr(kernel, "max_small_rows"):
        raise SystemExit(f"the linear kernel here is {type(kernel).__name__}, which has no small-batch row limit")
    limits = [int(v) for v in args.limits.split(",")]
    rng = random.Random(0)
    alone = _alternate(engine, kernel, limits, args.rounds, rng, "alone")
    decode = SamplingParams(max_tokens=2 * args.rounds + 40, ignore_eos=True)  # outlasts the timed steps
    for i in range(args.beside):
        engine.add_request(f"decode-{i}", [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)], decode)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    beside = _alternate(engine, kernel, limits, args.rounds, rng, "beside")
    print(f"{args.model}, {args.dtype}; median ms of {args.rounds} steps at each limit, taken in turn")
    print(f"| step | {' | '.join(f'limit {limit}' for limit in limits)} | first / last |")
    print(f"|---|{'---|' * len(limits)}---|")
    for name, times in ((f"one {PROMPT_TOKENS}-token prompt alone", alone),
                        (f"one {PROMPT_TOKENS}-token prompt beside {args.beside} decodes", beside)):
        cells = " | ".join(f"{times[limit]:.1f}" for limit in limits)
        print(f"| {name} | {cells} | {times[limits[0]] / times[limits[-1]]:.3f}x |")


if __name__ == "__main__":
    main()
