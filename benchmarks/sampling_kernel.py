"""The sampler's last stage on CPU: PyTorch's ops (float32 copy, / temperature, softmax, float64
cumulative sum, search; argmax for greedy rows) against the compiled sample_rows
(tengyun/csrc/sampling.cpp) on the same logits and uniforms, SmolLM2's vocabulary by default.
Then the filters Qwen's generation_config asks for (temperature 0.7, top_k 20, top_p 0.8): the
whole-vocabulary path against the top_k candidates (layers/sampler.py, _top_k_candidates).

    OMP_NUM_THREADS=2 python benchmarks/sampling_kernel.py [--vocab 49152] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_attention_bandwidth import best_ms  # noqa: E402

from tengyun.layers.attention import cpu_kernels  # noqa: E402
from tengyun.layers.sampler import sample_from_probs  # noqa: E402


def table_row(op, rows: int, vocab: int, dtype: torch.dtype, gen: torch.Generator) -> str:
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    temperature = torch.full((rows,), 0.8)
    u = torch.rand(rows, dtype=torch.float64, generator=gen)

    def pytorch_draw():
        return sample_from_probs((logits.float() / temperature.unsqueeze(1)).softmax(dim=-1), u)

    same = torch.equal(pytorch_draw(), op(logits, temperature, u))
    times = [best_ms(fn, rounds=20) for fn in (pytorch_draw, lambda: op(logits, temperature, u),
                                               lambda: logits.float().argmax(dim=-1), lambda: op(logits))]
    return f"| {rows} | " + " | ".join(f"{ms:.3f}" for ms in times) + f" | {same} |"


def filtered_row(rows: int, vocab: int, dtype: torch.dtype, gen: torch.Generator) -> str:
    from tengyun.layers.sampler import SamplingMetadata, _sample_random, _sample_vocabulary
    from tengyun.sampling_params import SamplingParams

    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype).float()  # the sampler widens first
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.8)] * rows
    md = SamplingMetadata.build(params, [[]] * rows, [[]] * rows, vocab, torch.device("cpu"))
    torch.manual_seed(0)
    want = _sample_vocabulary(logits, md)
    torch.manual_seed(0)
    same = torch.equal(_sample_random(logits, md), want)
    times = [best_ms(lambda: _sample_vocabulary(logits, md), rounds=10), best_ms(lambda: _sample_random(logits, md))]
    return f"| {rows} | " + " | ".join(f"{ms:.3f}" for ms in times) + f" | {same} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--rows", default="1,16,64")
    args = parser.parse_args()
    error = cpu_kernels.load_error()
    if error:
        raise SystemExit(f"no kernel to compare: {error}")
    op = torch.ops.tengyun.sample_rows.default
    gen = torch.Generator().manual_seed(0)
    print(f"vocab {args.vocab}, {args.dtype} logits, {torch.get_num_threads()} threads, best of 20 (ms)")
    print("| rows | draw: PyTorch | draw: kernel | argmax: PyTorch | argmax: kernel | same draws |")
    print("|---|---|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        print(table_row(op, rows, args.vocab, getattr(torch, args.dtype), gen))
    print("\n| rows | top_k 20, top_p 0.8, t 0.7: vocabulary | candidates | same draws |\n|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        print(filtered_row(rows, args.vocab, getattr(torch, args.dtype), gen))


if __name__ == "__main__":
    main()
