"""Qwen3.5-MoE text model: Qwen3.5's hybrid layers with a sparse MoE block as every layer's MLP
(top-k softmax routing, renormalised, plus a shared expert scaled by sigmoid(shared_expert_gate))."""

from __future__ import annotations

import torch
from torch import nn

from tengyun.layers.fused_moe import FusedMoE
from tengyun.layers.linear import ReplicatedLinear
from tengyun.model_spec import ModelSpec
from tengyun.models.llama import LlamaMLP
from tengyun.models.qwen3_5 import Qwen3_5ForCausalLM


class Qwen3_5MoeSparseMoeBlock(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        hidden, moe = spec.hidden_size, spec.moe
        self.gate = ReplicatedLinear(hidden, moe.num_experts, False, dtype)  # router
        self.experts = FusedMoE(moe.num_experts, moe.top_k, hidden, moe.intermediate_size, True, dtype)
        self.shared_expert = LlamaMLP(hidden, moe.shared_intermediate_size, dtype)
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> routed experts + sigmoid(gate) * shared expert, [T, H]."""
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, self.gate(x)) + shared


def make_moe_mlp(spec: ModelSpec, layer_idx: int, dtype: torch.dtype) -> nn.Module:
    return Qwen3_5MoeSparseMoeBlock(spec, dtype)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Also Qwen3_5MoeForConditionalGeneration (text weights only). Experts load per expert
    (``experts.N.gate_proj.weight``, as save_pretrained and the FP8 releases write them) or fused
    (``experts.gate_up_proj`` / ``experts.down_proj`` 3-D, as the bf16 releases hold them)."""

    make_mlp = staticmethod(make_moe_mlp)
    checkpoint_name_to_param = staticmethod(FusedMoE.checkpoint_name_to_param)
    checkpoint_transform = staticmethod(FusedMoE.split_fused_experts)
