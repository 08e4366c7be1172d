"""`tengyun quantize MODEL OUT_DIR --scheme w8a8|w4a16`: write a compressed-tensors checkpoint
(tengyun/ops/quantize.py) that Tengyun and vLLM load."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "quantize", help="round-to-nearest W8A8 (int8) or W4A16 (int4) quantization into a compressed-tensors "
                         "folder, as llm-compressor writes it")
    parser.add_argument("model", help="an HF folder (safetensors), a .gguf file, or an embedded model name")
    parser.add_argument("out_dir", help="the folder to write (new or empty)")
    parser.add_argument("--scheme", required=True, choices=("w8a8", "w4a16"),
                        help="w8a8: int8 per-channel weights, int8 per-token activations at run time; "
                             "w4a16: int4 weights in groups, 16-bit activations")
    parser.add_argument("--group-size", type=int, default=128,
                        help="input features per int4 scale (w4a16): 32, 64, 128 or 256, or 0 for one scale per "
                             "output channel (default 128)")
    parser.add_argument("--quantize-lm-head", action="store_true",
                        help="quantize the LM head too, targeted by name as vLLM loads it: w8a8 as the rest, "
                             "w4a16 at 8 bits per channel (W8A16); a head tied to the embedding is untied (lm_head "
                             "quantized from it, the embedding kept for lookups); by default it stays 16-bit, "
                             "as llm-compressor's presets keep it")


def run(args: argparse.Namespace) -> int:
    from tengyun.models.model_source import resolve_model
    from tengyun.ops.quantize import quantize_folder

    source = resolve_model(args.model)
    result = quantize_folder(source.folder, args.out_dir, args.scheme, args.group_size or None,
                             head=args.quantize_lm_head)
    print(f"Wrote {result.out_dir}: {result.quantized} linear weights quantized ({args.scheme}), "
          f"{result.copied} tensors copied; {result.bytes_in / 2**20:.1f} MiB -> {result.bytes_out / 2**20:.1f} MiB")
    return 0
