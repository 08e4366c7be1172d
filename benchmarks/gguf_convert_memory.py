"""Peak memory of converting a .gguf, kept quantised (`--quantization gguf`) or dequantized to
float32 (`--dequantized`, the default load), in a fresh cache: Tengyun's conversion
(gguf_quantized.stream_tensors, tensor by tensor, written in shards), or with `--read full`
transformers' own full load of the same file (load_gguf_checkpoint with every tensor in float32,
what `from_pretrained(gguf_file=...)` holds, and what Tengyun's conversion was built on until
2026-12-02) for scale. One run per process; peak RSS from getrusage.

    PYTHONPATH=$PWD python benchmarks/gguf_convert_memory.py --model qwen2.5-coder --read streamed
    PYTHONPATH=$PWD python benchmarks/gguf_convert_memory.py --model qwen2.5-coder --read streamed --dequantized
    PYTHONPATH=$PWD python benchmarks/gguf_convert_memory.py --model qwen2.5-coder --read full
    PYTHONPATH=$PWD python benchmarks/gguf_convert_memory.py --model synthetic-moe [--dequantized | --read full]

synthetic-moe: a random Qwen3-MoE .gguf written once (in a child process) by the tests' own
writer (tests/quantization/gguf_files.py), 4 layers of 64 experts, hidden 1024, expert width 512
(403 M expert parameters: 1.6 GB in float32), experts Q8_0 (gate, up) and Q4_0 (down).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MOE = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=4, moe_intermediate_size=512,
           mlp_only_layers=[])
MOE_TYPES = {"ffn_gate_exps.weight": "Q8_0", "ffn_up_exps.weight": "Q8_0", "ffn_down_exps.weight": "Q4_0"}


def build_synthetic_moe(out: Path) -> None:
    """The synthetic-moe .gguf at ``out`` (run in its own process: the writer holds everything)."""
    sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "quantization")]
    from conftest import CORPUS, make_tiny_checkpoint
    from gguf_files import write_gguf
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    work = Path(tempfile.mkdtemp(prefix="tengyun-moe-"))
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>").save_pretrained(work / "tokenizer")
    hf = make_tiny_checkpoint(work / "hf", work / "tokenizer", "qwen3_moe", initializer_range=0.02, **MOE)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(hf, out.with_suffix(".partial"), MOE_TYPES).rename(out)
    shutil.rmtree(work, ignore_errors=True)


def synthetic_moe() -> Path:
    cache = Path(os.environ.get("TENGYUN_BENCH_CACHE", Path.home() / ".cache" / "tengyun" / "bench"))
    path = cache / "synthetic-moe-q8_0-q4_0.gguf"
    if not path.exists():
        subprocess.run([sys.executable, __file__, "--build-moe", str(path)], check=True)
    return path


def full_load(gguf_file) -> None:
    """transformers' load_gguf_checkpoint of every tensor in float32, onto the model's names."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tengyun.models import model_source

    config = model_source._gguf_config(AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name),
                                       gguf_file)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("smollm2", "qwen2.5-coder", "synthetic-moe"), default="qwen2.5-coder")
    parser.add_argument("--read", choices=("streamed", "full"), default="streamed")
    parser.add_argument("--dequantized", action="store_true", help="the float32 conversion (no --quantization)")
    parser.add_argument("--build-moe", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build_moe:
        build_synthetic_moe(args.build_moe)
        return
    moe_file = synthetic_moe() if args.model == "synthetic-moe" else None
    cache = os.environ["TENGYUN_CACHE_DIR"] = tempfile.mkdtemp(prefix="tengyun-convert-")  # before tengyun reads it
    from tengyun.models import model_source

    gguf_file = moe_file or (model_source.qwen_coder_gguf() if args.model == "qwen2.5-coder"
                             else model_source.smollm2_gguf())
    start = time.perf_counter()
    if args.read == "full":
        full_load(gguf_file)
        kind = "transformers' full load"
    else:
        model_source.convert_gguf(gguf_file, keep_quantized=not args.dequantized)
        kind = "dequantized" if args.dequantized else "kept quantised"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.model}, {kind}, {args.read} read: {time.perf_counter() - start:.1f} s, peak RSS {peak:.0f} MiB")
    shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
