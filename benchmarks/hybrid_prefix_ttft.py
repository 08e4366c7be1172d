"""TTFT behind a shared 1,024-token prefix on a Qwen3.5-shaped random model, prefix caching on vs
off: the hybrid prefix cache (Gated DeltaNet state snapshots, docs/hybrid_cache.md) against
recomputing every prompt. Builds the model folder (config.json of Qwen3.5's layer pattern and
head sizes, scaled to ~SmolLM2-135M's cost, random weights via --load-format dummy; a BPE
tokenizer trained here), then runs `tengyun bench throughput --compare-prefix-caching`.

    OMP_NUM_THREADS=2 python benchmarks/hybrid_prefix_ttft.py [--folder DIR] [--num-prompts 32]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
from pathlib import Path

# Qwen3.5's pattern (3 Gated DeltaNet layers, then one gated full-attention layer) and head sizes
# (attention head_dim 256, linear key/value head dim 128), narrower and shallower.
CONFIG = dict(hidden_size=640, intermediate_size=1792, num_hidden_layers=16, num_attention_heads=4,
              num_key_value_heads=2, head_dim=256, linear_num_key_heads=4, linear_num_value_heads=8,
              linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
              max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True)


def build_folder(folder: Path) -> Path:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast, Qwen3_5TextConfig

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    corpus = [" ".join(rng.choice(words) for _ in range(50)) for _ in range(400)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=2048, special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                        bos_token="<|endoftext|>")
    tokenizer.save_pretrained(folder)
    config = Qwen3_5TextConfig(vocab_size=len(tokenizer), eos_token_id=0, bos_token_id=0, **CONFIG)
    config.architectures = ["Qwen3_5ForCausalLM"]
    config.save_pretrained(folder)
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=None, help="where to write the model folder (default: a temp dir)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    folder = Path(args.folder or tempfile.mkdtemp(prefix="qwen3_5_shaped_"))
    folder.mkdir(parents=True, exist_ok=True)
    build_folder(folder)
    command = [sys.executable, "-m", "tengyun.entrypoints.cli.main", "bench", "throughput", "--model", str(folder),
               "--load-format", "dummy", "--dtype", "float32", "--dataset", "shared-prefix", "--prefix-len", "1024",
               "--input-len", "32", "--output-len", "16", "--num-prompts", str(args.num_prompts),
               "--kv-cache-memory", "2GiB", "--max-model-len", "2048", "--compare-prefix-caching", "--disable-tqdm"]
    if args.output_json:
        command += ["--output-json", args.output_json]
    print(" ".join(command), flush=True)
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
