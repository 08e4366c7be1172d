"""Batch-1 W8A8 decode with and without the compiled small-batch kernel, in one process: the same
engine alternates between torch._int_mm for every row count (every CpuW8A8Kernel's
max_gemv_rows set to 0: the compiled quantise + _int_mm + rescale path) and the one-call
int8_gemv kernel (tengyun/csrc/int8_gemv.cpp) up to 8 rows. Each pass: 1 x PROMPT random ids,
OUTPUT greedy tokens (ignore_eos); decode tok/s = (OUTPUT - 1) / (last token - first token).
Prints the median of each side and whether both produced the same tokens (they must: the
kernel's outputs are bit-equal).

    OMP_NUM_THREADS=2 python benchmarks/w8a8_gemv_decode.py [FOLDER] --passes 5

FOLDER defaults to benchmarks/quant.py's SmolLM2 W8A8 folder (`tengyun quantize`, cached under
~/.cache/tengyun/quantized/smollm2-w8a8; run quant.py once to make it).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from tengyun import LLM, SamplingParams
from tengyun.platforms.cpu_quant import MAX_GEMV_ROWS, CpuW8A8Kernel

DEFAULT_FOLDER = Path.home() / ".cache" / "tengyun" / "quantized" / "smollm2-w8a8"


def set_gemv_rows(model: torch.nn.Module, rows: int) -> int:
    """Every W8A8 layer's kernel (one per scheme, shared) runs int8_gemv up to ``rows`` rows -> how
    many layers."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "kernel", None), CpuW8A8Kernel)]
    for layer in layers:
        layer.kernel.max_gemv_rows = rows
    return len(layers)


def decode_pass(engine, prompt: list[int], output_len: int, tag: str) -> tuple[float, list[int]]:
    """One request -> (decode tok/s, its tokens)."""
    engine.add_request(tag, prompt, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    stamps, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced = list(out.outputs[0].token_ids) if out.outputs else []
            stamps += [time.perf_counter()] * (len(produced) - len(stamps))
            tokens = produced
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", nargs="?", default=str(DEFAULT_FOLDER))
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    llm = LLM(args.folder, max_model_len=512, kv_cache_memory="64MiB")
    engine = llm.llm_engine
    model = engine.executor.model
    prompt = random.Random(0).choices(range(1000, 20000), k=args.prompt_len)
    sides = {"_int_mm (max_gemv_rows 0)": 0, f"int8_gemv (max_gemv_rows {MAX_GEMV_ROWS})": MAX_GEMV_ROWS}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.folder}: "
          f"{set_gemv_rows(model, MAX_GEMV_ROWS)} W8A8 layers")
    decode_pass(engine, prompt[:8], 4, "warm-up")
    rates: dict[str, list[float]] = {name: [] for name in sides}
    tokens: dict[str, list[int]] = {}
    for i in range(args.passes):
        for name, rows in (sides.items() if i % 2 == 0 else reversed(sides.items())):
            set_gemv_rows(model, rows)
            rate, tokens[name] = decode_pass(engine, prompt, args.output_len, f"{i}-{rows}")
            rates[name].append(rate)
    for name, values in rates.items():
        print(f"{name}: decode tok/s median {statistics.median(values):.1f} (all: "
              + ", ".join(f"{v:.1f}" for v in values) + ")")
    print("same tokens:", len(set(map(tuple, tokens.values()))) == 1)


if __name__ == "__main__":
    main()
