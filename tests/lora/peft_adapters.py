"""PEFT adapters made in the test: random A and non-zero random B (PEFT starts B at zero, which
would make every adapter the base model), saved as PEFT saves them."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base_folder: Path, out_folder: Path, seed: int, r: int = 4, lora_alpha: int = 8,
                      targets: list[str] | None = None, use_rslora: bool = False, **config):
    """Save an adapter of ``base_folder`` into ``out_folder``; -> the PEFT model (fp32, eval), the reference."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    lora = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=targets or ALL_TARGETS, use_rslora=use_rslora,
                      lora_dropout=0.0, **config)
    model = get_peft_model(base, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    model.save_pretrained(out_folder)
    return model.eval()
