"""Make the PEFT LoRA adapter that stands in for a hub LoRA repo the tests download.

    /work/main/.venv/bin/python make_lora_adapter.py --base-config DIR --out DIR [--rank 64 --alpha 16]

vLLM's tests serve `typeof/zephyr-7b-beta-lora` on zephyr-7b-beta; here zephyr is replaced by
the stand-in model (adapt.py MODEL_MAP), so its adapter is replaced by a real PEFT adapter made
for the stand-in model: `peft.get_peft_model` on the model built from the stand-in's config.json,
targets q/k/v/o/gate/up/down of every layer, rank 64 and alpha 16 (the zephyr adapter's, and the
tests' --max-lora-rank 64), PEFT's own A (Kaiming-uniform), and B drawn from N(0, B_STD^2)
instead of PEFT's zeros, so the adapter changes the model's outputs. Seeded: the same folder
every time. Run with a Python that has torch, transformers and peft (Tengyun's dev venv).

The adapter never depends on the base weights, so the model is built with random weights and a
16-token vocabulary (embeddings and LM head are not targets; every targeted shape is the model's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# B's spread: large enough that the adapted model's greedy tokens differ from the base model's,
# small enough that it still writes text (checked on Qwen2.5-Coder-0.5B: README)
B_STD = 0.02


def make_adapter(base_config: Path, out: Path, rank: int, alpha: int, seed: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(base_config)
    config.vocab_size = 16
    config.pad_token_id = config.bos_token_id = config.eos_token_id = 0
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGET_MODULES,
                                                  lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, B_STD)
    peft_model.save_pretrained(out, safe_serialization=True, save_embedding_layers=False)
    # the hub id of the model it was made for, as PEFT records it when trained on a hub model
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = str(base_config)
    cfg_path.write_text(json.dumps(cfg, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-config", type=Path, required=True, help="folder holding the stand-in's config.json")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--alpha", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    make_adapter(a.base_config, a.out, a.rank, a.alpha, a.seed)
    print(f"PEFT adapter r={a.rank} alpha={a.alpha} on {', '.join(TARGET_MODULES)} -> {a.out}")


if __name__ == "__main__":
    main()
