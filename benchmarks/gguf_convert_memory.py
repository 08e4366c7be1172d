"""Peak memory of converting a .gguf, kept quantised (`--quantization gguf`) or dequantized to
float32 (`--dequantized`, the default load), in a fresh cache: the tensor-by-tensor read
(gguf_quantized.stream_tensors, what dense models take now, written in shards) or the full load
(transformers' load_gguf_checkpoint, every tensor in float32, then keep_blocks; what MoE files
still take). One conversion per process; peak RSS from getrusage.

    PYTHONPATH=$PWD python benchmarks/gguf_convert_memory.py --model qwen2.5-coder --read streamed
    PYTHONPATH=$PWD python benchmarks/gguf_convert_memory.py --model qwen2.5-coder --read full
    PYTHONPATH=$PWD python benchmarks/gguf_convert_memory.py --model qwen2.5-coder --read streamed --dequantized
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("smollm2", "qwen2.5-coder"), default="qwen2.5-coder")
    parser.add_argument("--read", choices=("streamed", "full"), default="streamed")
    parser.add_argument("--dequantized", action="store_true", help="the float32 conversion (no --quantization)")
    args = parser.parse_args()
    cache = os.environ["TENGYUN_CACHE_DIR"] = tempfile.mkdtemp(prefix="tengyun-convert-")  # before tengyun reads it
    from tengyun.models import gguf_quantized, model_source

    if args.read == "full":
        gguf_quantized.holds_experts = lambda _: True  # the path MoE files take
    gguf_file = model_source.qwen_coder_gguf() if args.model == "qwen2.5-coder" else model_source.smollm2_gguf()
    start = time.perf_counter()
    model_source.convert_gguf(gguf_file, keep_quantized=not args.dequantized)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kind = "dequantized" if args.dequantized else "kept quantised"
    print(f"{args.model}, {kind}, {args.read} read: {time.perf_counter() - start:.1f} s, peak RSS {peak:.0f} MiB")
    shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
