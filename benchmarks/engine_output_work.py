"""The engine's per-step output work, with the detokenizer's Rust-backend path (engine/detokenizer.py,
text_decoder) on and off, side by side in one process:

- incremental detokenizing of ~580 tokens of this repository's text (CJK and emoji appended), one
  token at a time, for each model's tokenizer: microseconds a token, best of 3;
- the engine's ``_apply`` (tokens appended, stops checked, DELTA outputs and progress built) at 64
  streams: 64 text prompts of 128 random token ids, SmolLM2 in bfloat16, 128 tokens each, the two
  paths alternating by round; median milliseconds a step, and the step message's pickled size.

    OMP_NUM_THREADS=2 python benchmarks/engine_output_work.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from tengyun import LLM, SamplingParams
from tengyun.engine import detokenizer
from tengyun.engine.async_engine import StepResult
from tengyun.engine.prompt_elision import PromptSender
from tengyun.models.model_source import resolve_model
from tengyun.sampling_params import RequestOutputKind

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_profile import MODELS, timed  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
THROUGH_BACKEND = detokenizer.decodes_through_backend


def backend_path(on: bool) -> None:
    detokenizer.decodes_through_backend = THROUGH_BACKEND if on else (lambda cls: False)


def per_token_us(tokenizer, on: bool) -> float:
    text = (REPO / "tengyun/engine/llm_engine.py").read_text()[:6000] + " 你好，世界！ こんにちは 🙂🙂 naïve"
    ids = tokenizer.encode(text)[:600]
    backend_path(on)
    best = float("inf")
    for _ in range(3):
        detok = detokenizer.IncrementalDetokenizer(tokenizer, ids[:20], SamplingParams(max_tokens=1000))
        start = time.perf_counter()
        for token in ids[20:]:
            detok.update([token])
        best = min(best, time.perf_counter() - start)
    return 1e6 * best / len(ids[20:])


def apply_round(llm: LLM, on: bool, seed: int) -> tuple[list[float], int]:
    """One wave of 64 DELTA requests to the end: _apply's seconds per step, median message bytes."""
    engine, rng = llm.llm_engine, random.Random(seed)
    backend_path(on)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    for i in range(64):
        engine.add_request(f"{seed}-{i}", engine.tokenizer.decode([rng.randrange(1000, 20000) for _ in range(128)]),
                           params)
    times: dict[str, list[float]] = {}
    timed(engine, "_apply", times)
    sender, sizes = PromptSender(), []
    while engine.has_unfinished_requests():
        outputs, progress = engine.step_with_progress()
        sizes.append(len(pickle.dumps(sender.slim(StepResult(outputs, engine.get_stats(), {}, progress)))))
    del engine._apply  # the class's own again
    return times["_apply"], int(statistics.median(sizes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print("| tokenizer | us a token, transformers' decode | through the backend |\n|---|---|---|")
    for name, model in MODELS.items():
        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(model, "auto").folder))
        print(f"| {name} | {per_token_us(tokenizer, False):.1f} | {per_token_us(tokenizer, True):.1f} |")
    llm = LLM(str(resolve_model(MODELS["smollm2"], "auto").folder), dtype="bfloat16", kv_cache_memory="1GiB",
              max_model_len=512, max_num_seqs=64)
    print("\n| round | path | _apply median ms a step | steps | message bytes (median) |\n|---|---|---|---|---|")
    for r in range(args.rounds):
        for on in (False, True):
            seconds, size = apply_round(llm, on, seed=2 * r + on)
            print(f"| {r + 1} | {'backend' if on else 'transformers'} | {1e3 * statistics.median(seconds):.2f} | "
                  f"{len(seconds)} | {size} |", flush=True)
    backend_path(True)


if __name__ == "__main__":
    main()
