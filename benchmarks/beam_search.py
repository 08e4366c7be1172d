"""Beam search two ways on one engine (the embedded SmolLM2-135M-Instruct, prefix caching on):

  in-engine   LLM.beam_search: beams fork their parent's KV blocks (copy on write of the partly
              filled last block), each round computes one token per beam
  front-end   vLLM 0.11's loop over LLM.generate: each round, every live beam is a new 1-token
              request (logprobs 2 x width) whose prompt is the beam's tokens; the prefix cache
              serves its full blocks, its partly filled last block is computed again

Prints, per beam width: tokens the model computed, prefix-cache hit tokens, wall time, and
whether the two found the same beams.

    OMP_NUM_THREADS=2 python benchmarks/beam_search.py
"""

from __future__ import annotations

import argparse
import platform
import time

from tengyun import LLM, BeamSearchParams, SamplingParams
from tengyun.beam_search import create_sort_beams_key_function

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. The keeper has "
          "lived alone on the island for twenty years and knows every rock and every wave. One morning")


def front_end_beam_search(llm: LLM, prompt: list[int], width: int, max_tokens: int) -> list[list[int]]:
    """vLLM 0.11's LLM.beam_search loop (length_penalty 1, EOS off): (tokens, cum logprob) beams
    advanced by one-token requests."""
    key = create_sort_beams_key_function(set(), 1.0)
    beams = [(list(prompt), 0.0)]
    step = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * width, ignore_eos=True)
    for _ in range(max_tokens):
        outputs = llm.generate([{"prompt_token_ids": tokens} for tokens, _ in beams], step)
        candidates = [(tokens + [token], cum + logprob.logprob)
                      for (tokens, cum), out in zip(beams, outputs)
                      for token, logprob in out.outputs[0].logprobs[0].items()]
        candidates.sort(key=lambda beam: key(_Beam(*beam)), reverse=True)
        beams = candidates[:width]
    return [tokens for tokens, _ in beams]


class _Beam:
    def __init__(self, tokens, cum_logprob):
        self.tokens, self.cum_logprob = tokens, cum_logprob


def measured(llm: LLM, run, *args) -> tuple[object, int, int, float]:
    """(run(*args)'s result, tokens computed by llm's engine, its prefix-cache hit tokens, seconds)."""
    engine = llm.llm_engine
    real, computed = engine.executor.execute_model, [0]

    def counting(sched):
        computed[0] += sched.total_num_scheduled_tokens
        return real(sched)

    hits_before = engine.get_stats().prefix_cache_hits
    engine.executor.execute_model = counting
    start = time.perf_counter()
    try:
        result = run(*args)
    finally:
        engine.executor.execute_model = real
    return result, computed[0], engine.get_stats().prefix_cache_hits - hits_before, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    # one engine per design, so neither finds the other's blocks in its prefix cache
    engines = [LLM(dtype="float32", max_model_len=512, kv_cache_memory="256MiB", block_size=args.block_size)
               for _ in range(2)]
    prompt = engines[0].get_tokenizer().encode(PROMPT)
    print(f"# {platform.processor() or platform.machine()}, prompt {len(prompt) + 1} tokens, "
          f"max_tokens {args.max_tokens}, block size {args.block_size}, length_penalty 1, EOS off")
    print("| width | design | tokens computed | prefix-cache hits | seconds | same beams |")
    print("|---|---|---|---|---|---|")
    for width in args.widths:
        params = BeamSearchParams(beam_width=width, max_tokens=args.max_tokens, ignore_eos=True)
        width_prompt = prompt + [width]  # a prompt no earlier width cached
        ours, ours_tokens, ours_hits, ours_s = measured(
            engines[0], engines[0].beam_search, [{"prompt_token_ids": width_prompt}], params)
        theirs, front_tokens, front_hits, front_s = measured(
            engines[1], front_end_beam_search, engines[1], width_prompt, width, args.max_tokens)
        same = [b.tokens for b in ours[0].sequences] == theirs
        print(f"| {width} | in-engine | {ours_tokens} | {ours_hits} | {ours_s:.2f} | |")
        print(f"| {width} | front-end | {front_tokens} | {front_hits} | {front_s:.2f} | {same} |")


if __name__ == "__main__":
    main()
