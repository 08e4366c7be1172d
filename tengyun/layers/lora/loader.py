"""A checked PEFT adapter (tengyun/lora/peft_adapter.py) read into the slot layout of this rank's
LoRA layers (layer.py): per layer a [K, in] and b [K, out] on the host, B scaled, TP-split."""

from __future__ import annotations

import torch

from tengyun.lora.peft_adapter import PeftAdapter
from tengyun.lora.targets import TARGETS

AdapterWeights = dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer name -> (a [K, in], b [K, out])


def load_adapter(adapter: PeftAdapter, layers: dict, max_rank: int, dtype: torch.dtype) -> AdapterWeights:
    """``layers``: model name ("model.layers.0.self_attn.qkv_proj") -> the base linear of this rank
    (its ``_in_part`` / ``_out_parts`` say which inputs and outputs the rank holds). Modules of
    layers another pipeline stage holds are skipped."""
    from safetensors import safe_open

    weights: AdapterWeights = {}
    with safe_open(str(adapter.weights_file), framework="pt") as f:
        for module in adapter.modules:
            target = TARGETS[module.module]
            name = f"model.layers.{module.layer}.{target.layer}"
            linear = layers.get(name)
            if linear is None:
                continue
            rows = target.num_slices * max_rank
            a, b = weights.setdefault(name, (torch.zeros(rows, linear.in_features, dtype=torch.float32),
                                             torch.zeros(rows, linear.out_features, dtype=torch.float32)))
            first = target.slice_index * max_rank
            a_full = f.get_tensor(module.a_key).float()  # [r, in_total]
            if linear.in_features != linear.in_total:  # row-parallel: this rank's inputs
                start, count = linear._in_part()
                a_full = a_full.narrow(1, start, count)
            a[first:first + adapter.rank] = a_full
            b_full = f.get_tensor(module.b_key).float() * adapter.scaling  # [out_total, r]
            parts, _ = linear._out_parts(target.shard_id)
            for dst, count, src in parts:
                b[first:first + adapter.rank, dst:dst + count] = b_full[src:src + count].t()
    return {name: (a.to(dtype), b.to(dtype)) for name, (a, b) in weights.items()}
