"""The floor of an offline-throughput workload on this CPU: how fast could any engine run it if
it did nothing but the model's linear layers, each at the best rate this machine's oneDNN
reaches for that shape, and the decode attention's reads of the KV cache at memory bandwidth?

For N prompts x IN tokens in / OUT tokens out (the workload of benchmarks/compare), every
decoder linear layer (q/k/v fused, o, gate/up fused, down) runs over every prompt token in
prefill steps of --chunk rows (Tengyun's and vLLM's default 2048 batched tokens) and over every
generated token but the first in decode steps of N rows; the LM head runs on N rows per step
(the prompts' last rows, then each decode step). Each shape is timed alone, cycling over one
weight per decoder layer (so they stream from memory as in a step), prepacked for oneDNN
(torch.ops.mkldnn._linear_pointwise, what Tengyun runs on CPU) and as plain F.linear; the faster
counts. Every decode step also reads each sequence's cached K and V once, timed at the bandwidth
of a 2-thread sum over 1 GiB. Attention's arithmetic, norms, rotary, sampling and the engine
itself add to this, so a real engine's wall time is above the floor.

    PYTHONPATH=$PWD OMP_NUM_THREADS=2 python benchmarks/matmul_floor.py --model smollm2 --num-prompts 64 \\
        --measured tengyun=229.5,vllm=206.4
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODELS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "qwen2.5-coder": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}


def model_shapes(model: str) -> tuple[dict, dict[str, tuple[int, int]]]:
    """config.json of the model's converted HF folder -> (config, {layer: (out, in)})."""
    from tengyun.models.model_source import resolve_model

    config = json.loads((resolve_model(MODELS.get(model, model)).folder / "config.json").read_text())
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    d = config.get("head_dim") or h // heads
    layer = {"qkv": ((heads + 2 * kv) * d, h), "o": (h, heads * d), "gate_up": (2 * inter, h), "down": (h, inter)}
    return config, {**layer, "lm_head": (config["vocab_size"], h)}


def gemm_seconds(out: int, in_: int, rows: int, dtype: torch.dtype, copies: int, calls: int) -> tuple[float, str]:
    """Best time of one [rows, in] x [in, out] matmul, cycling over ``copies`` weights (one per
    decoder layer, so they stream from memory as in a step): (seconds, which library call)."""
    weights = [torch.randn(out, in_, dtype=dtype) for _ in range(copies)]
    x = torch.randn(rows, in_, dtype=dtype)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    candidates = {"onednn-packed": lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                  "F.linear": lambda w: F.linear(x, w)}
    held = {"onednn-packed": packed, "F.linear": weights}
    best = {}
    for name, fn in candidates.items():
        fn(held[name][0])
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for call in range(calls):
                fn(held[name][call % copies])
            times.append((time.perf_counter() - start) / calls)
        best[name] = min(times)
    name = min(best, key=best.get)
    return best[name], name


def floor(model: str, num_prompts: int, input_len: int, output_len: int, chunk: int, dtype: torch.dtype) -> dict:
    config, shapes = model_shapes(model)
    layers = config["num_hidden_layers"]
    prompt_tokens, decode_tokens = num_prompts * input_len, num_prompts * (output_len - 1)
    rows_of = {"prefill": min(chunk, prompt_tokens), "decode": num_prompts}
    tokens_of = {"prefill": prompt_tokens, "decode": decode_tokens}
    table, total_s, total_flop = [], 0.0, 0.0
    for phase in ("prefill", "decode"):
        rows = rows_of[phase]
        for name, (out, in_) in shapes.items():
            if name == "lm_head":  # N rows a step: the prompts' last rows, then each decode step
                count, step_rows = (1 if phase == "prefill" else output_len - 1), num_prompts
            else:
                count, step_rows = layers * tokens_of[phase] / rows, rows
            one_flop = 2 * out * in_ * step_rows
            copies = 1 if name == "lm_head" else layers
            seconds, via = gemm_seconds(out, in_, step_rows, dtype, copies, calls=max(copies, int(4e9 / one_flop)))
            flop = one_flop * count
            table.append({"phase": phase, "layer": name, "shape": f"[{step_rows} x {in_}] x [{in_} x {out}]",
                          "calls": count, "gflops": one_flop / seconds / 1e9, "seconds": seconds * count, "via": via})
            total_s, total_flop = total_s + seconds * count, total_flop + flop
    kv_s, kv_gb = kv_read_seconds(config, num_prompts, input_len, output_len, dtype)
    table.append({"phase": "decode", "layer": "attention: read the KV cache", "shape": f"{kv_gb:.1f} GB in all",
                  "calls": output_len - 1, "gflops": 0, "seconds": kv_s, "via": "memory bandwidth"})
    total_s += kv_s
    return {"rows": table, "seconds": total_s, "tflop": total_flop / 1e12,
            "output_tok_s": num_prompts * output_len / total_s}


def kv_read_seconds(config: dict, num_prompts: int, input_len: int, output_len: int,
                    dtype: torch.dtype) -> tuple[float, float]:
    """Decode attention reads every cached K and V once a step: bytes over all decode steps, at
    the bandwidth a 2-thread sum over 1 GiB reaches here. -> (seconds, GB)."""
    heads = config["num_attention_heads"]
    kv_heads, d = config.get("num_key_value_heads", heads), config.get("head_dim") or config["hidden_size"] // heads
    per_token = 2 * kv_heads * d * config["num_hidden_layers"] * torch.finfo(dtype).bits // 8
    tokens = sum(num_prompts * (input_len + step) for step in range(1, output_len))
    big = torch.ones(2**30 // 4, dtype=torch.float32)
    big.sum()
    start = time.perf_counter()
    for _ in range(3):
        big.sum()
    bandwidth = 3 * big.numel() * 4 / (time.perf_counter() - start)
    return tokens * per_token / bandwidth, tokens * per_token / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill rows per step (max batched tokens)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--measured", default="", help="SYSTEM=output tok/s,... to set beside the floor")
    args = parser.parse_args()
    result = floor(args.model, args.num_prompts, args.input_len, args.output_len, args.chunk, DTYPES[args.dtype])
    print(f"{args.model}, {args.num_prompts} x {args.input_len}/{args.output_len}, {args.dtype}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print("| phase | work | one call | calls | GFLOP/s | seconds | via |\n|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['phase']} | {r['layer']} | {r['shape']} | {r['calls']:.0f} | {r['gflops']:.0f} | "
              f"{r['seconds']:.2f} | {r['via']} |")
    print(f"\nfloor: {result['tflop']:.2f} TFLOP of linear layers and the KV reads in {result['seconds']:.2f} s = "
          f"**{result['output_tok_s']:.1f} output tok/s** at most")
    for item in filter(None, args.measured.split(",")):
        system, value = item.split("=")
        print(f"- {system}: {float(value):.1f} output tok/s = {float(value) / result['output_tok_s']:.2f} of the floor")


if __name__ == "__main__":
    main()
