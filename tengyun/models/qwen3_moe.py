"""Qwen3MoeForCausalLM: Qwen3 attention; sparse MoE MLPs on every ``decoder_sparse_step``-th
layer outside ``mlp_only_layers`` (dense MLP elsewhere)."""

from __future__ import annotations

import torch
from torch import nn

from tengyun.layers.fused_moe import FusedMoE
from tengyun.layers.linear import ReplicatedLinear
from tengyun.model_spec import ModelSpec
from tengyun.models.llama import make_dense_mlp
from tengyun.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        moe = spec.moe
        self.gate = ReplicatedLinear(spec.hidden_size, moe.num_experts, False, dtype)  # router
        self.experts = FusedMoE(moe.num_experts, moe.top_k, spec.hidden_size, moe.intermediate_size,
                                spec.hf.get("norm_topk_prob", False), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


def make_moe_mlp(spec: ModelSpec, layer_idx: int, dtype: torch.dtype) -> nn.Module:
    """An MoE block where ModelSpec.sparse_layers says so, the dense MLP elsewhere."""
    if spec.sparse_layers[layer_idx]:
        return Qwen3MoeSparseMoeBlock(spec, dtype)
    return make_dense_mlp(spec, layer_idx, dtype)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    make_mlp = staticmethod(make_moe_mlp)
    # Per-expert checkpoint tensors land in the stacked expert parameters; fused 3-D ones are split first.
    checkpoint_name_to_param = staticmethod(FusedMoE.checkpoint_name_to_param)
    checkpoint_transform = staticmethod(FusedMoE.split_fused_experts)
