"""The sampler's last stage on CPU: PyTorch's ops (float32 copy, / temperature, softmax, float64
cumulative sum, search; argmax for greedy rows) against the compiled sample_rows
(tengyun/csrc/sampling.cpp) on the same logits and uniforms, SmolLM2's vocabulary by default.
Then the filters Qwen's generation_config asks for (temperature 0.7, top_k 20, top_p 0.8): the
whole-vocabulary path against the top_k candidates (layers/sampler.py, _top_k_candidates). Then
top_p without top_k: apply_top_p ranking the best TOP_P_CANDIDATES against ranking every logit
(its fallback), on logits whose best 256 weigh what the row says.

    OMP_NUM_THREADS=2 python benchmarks/sampling_kernel.py [--vocab 49152] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_attention_bandwidth import best_ms  # noqa: E402

from tengyun.platforms.cpu import native as cpu_kernels  # noqa: E402
from tengyun.layers.sampling.draw import sample_from_probs  # noqa: E402


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
    from tengyun.layers.sampling.draw import _sample_vocabulary
    from tengyun.layers.sampling.draw import sample_random as _sample_random
    from tengyun.layers.sampling.metadata import SamplingMetadata
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


def top_p_row(rows: int, vocab: int, scale: float, top_p: float, gen: torch.Generator) -> str:
    """apply_top_p on [rows, vocab] float32 logits (randn * ``scale``) with the short path, and
    with it off (TOP_P_CANDIDATES = vocab: every logit ranked)."""
    import tengyun.layers.sampling.filters as sampler

    logits = torch.randn(rows, vocab, generator=gen) * scale
    p = torch.full((rows,), top_p)
    mass = float(logits.softmax(dim=-1).topk(sampler.TOP_P_CANDIDATES, dim=-1).values.sum(dim=-1).min())
    short = sampler.apply_top_p(logits, p)
    default = sampler.TOP_P_CANDIDATES
    try:
        sampler.TOP_P_CANDIDATES = vocab
        whole = sampler.apply_top_p(logits, p)
        whole_ms = best_ms(lambda: sampler.apply_top_p(logits, p), rounds=5)
    finally:
        sampler.TOP_P_CANDIDATES = default
    short_ms = best_ms(lambda: sampler.apply_top_p(logits, p), rounds=10)
    same = torch.equal(short, whole)
    return f"| {rows} | {scale:g} | {top_p:g} | {mass:.3f} | {whole_ms:.2f} | {short_ms:.2f} | {same} |"


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
    print("\n| rows | logits randn x | top_p | best 256 weigh (min row) | every logit ranked | best 256 ranked "
          "| same kept |\n|---|---|---|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        for scale, top_p in ((4.0, 0.8), (4.0, 0.95), (2.0, 0.9)):
            print(top_p_row(rows, args.vocab, scale, top_p, gen))


if __name__ == "__main__":
    main()
