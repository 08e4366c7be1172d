"""Qwen3MoeForCausalLM: Qwen3 attention; sparse MoE MLPs on every ``decoder_sparse_step``-th
layer outside ``mlp_only_layers`` (dense MLP elsewhere)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tengyun.layers.fused_moe import FusedMoE
from tengyun.layers.linear import ReplicatedLinear
from tengyun.models.llama import make_dense_mlp
from tengyun.models.qwen3 import Qwen3ForCausalLM


def num_experts(cfg: dict[str, Any]) -> int:
    """Released checkpoints say num_experts; transformers >= 5 saves num_local_experts."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype):
        super().__init__()
        hidden = cfg["hidden_size"]
        self.gate = ReplicatedLinear(hidden, num_experts(cfg), False, dtype)  # router
        self.experts = FusedMoE(num_experts(cfg), cfg["num_experts_per_tok"], hidden,
                                cfg["moe_intermediate_size"], cfg.get("norm_topk_prob", False), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


def is_sparse_layer(cfg: dict[str, Any], layer_idx: int) -> bool:
    return (layer_idx not in (cfg.get("mlp_only_layers") or [])
            and num_experts(cfg) > 0
            and (layer_idx + 1) % cfg.get("decoder_sparse_step", 1) == 0)


def make_moe_mlp(cfg: dict[str, Any], layer_idx: int, dtype: torch.dtype) -> nn.Module:
    return Qwen3MoeSparseMoeBlock(cfg, dtype) if is_sparse_layer(cfg, layer_idx) else make_dense_mlp(cfg, layer_idx, dtype)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    make_mlp = staticmethod(make_moe_mlp)
    # Per-expert checkpoint tensors land in the stacked expert parameters.
    checkpoint_name_to_param = staticmethod(FusedMoE.checkpoint_name_to_param)
