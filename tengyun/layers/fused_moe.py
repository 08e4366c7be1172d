"""Sparse mixture-of-experts: top-k softmax routing, experts computed grouped by expert.

Experts are split across tensor-parallel ranks by expert id (rank r holds experts
[r * E / tp, (r + 1) * E / tp)); each rank computes the tokens routed to its experts and the
partial outputs are all-reduced, so every rank ends with the full result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tengyun.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from tengyun.layers.weight_loading import check_shape, set_weight_loader

# Checkpoint projection -> (stacked parameter, row block inside it)
_SHARDS = {"gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1), "down_proj": ("w2_weight", None)}


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k]).

    Softmax in float32 over all experts, then the top k; renormalize makes the k sum to 1.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


class FusedMoE(nn.Module):
    """Experts stacked per rank: w13 [E_local, 2 * I, H] (gate rows, then up), w2 [E_local, H, I]."""

    supports_graph_capture = False  # per-expert token counts go to the host every step

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype):
        super().__init__()
        self.tp_size = get_tp_size()
        if num_experts % self.tp_size:
            raise ValueError(f"num_experts ({num_experts}) is not divisible by --tensor-parallel-size {self.tp_size}.")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.num_local = num_experts // self.tp_size
        self.first_expert = get_tp_rank() * self.num_local
        self.intermediate_size = intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(self.num_local, 2 * intermediate_size, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.num_local, hidden_size, intermediate_size, dtype=dtype),
                                      requires_grad=False)
        local = range(self.first_expert, self.first_expert + self.num_local)
        # What the loader must find for this rank: (expert id, row block) per stacked parameter.
        self.w13_weight.shard_ids = [(e, block) for e in local for block in (0, 1)]
        self.w2_weight.shard_ids = [(e, None) for e in local]
        set_weight_loader(self.w13_weight, self.weight_loader)
        set_weight_loader(self.w2_weight, self.weight_loader)

    @staticmethod
    def checkpoint_name_to_param(name: str) -> tuple[str, tuple[int, int | None]] | None:
        """'...mlp.experts.5.up_proj.weight' -> ('...mlp.experts.w13_weight', (5, 1))."""
        prefix, sep, rest = name.partition(".experts.")
        parts = rest.split(".")
        if not sep or len(parts) != 3 or not parts[0].isdigit() or parts[1] not in _SHARDS or parts[2] != "weight":
            return None
        param, block = _SHARDS[parts[1]]
        return f"{prefix}.experts.{param}", (int(parts[0]), block)

    @staticmethod
    def split_fused_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """The fused 3-D layout of Qwen3.5-MoE's released checkpoints (and HF's modules) as per-expert
        tensors: '...mlp.experts.gate_up_proj' [E, 2I, H] (per expert: gate rows, then up) ->
        '...mlp.experts.{e}.gate_proj.weight' and '.up_proj.weight' [I, H]; '...mlp.experts.down_proj'
        [E, H, I] -> '...mlp.experts.{e}.down_proj.weight' [H, I]. Views, no copies. None: not fused."""
        prefix, sep, leaf = name.rpartition(".experts.")
        if not sep or leaf not in ("gate_up_proj", "down_proj") or tensor.dim() != 3:
            return None
        experts = range(tensor.shape[0])
        if leaf == "down_proj":
            return [(f"{prefix}.experts.{e}.down_proj.weight", tensor[e]) for e in experts]
        gate, up = tensor.chunk(2, dim=1)
        return [(f"{prefix}.experts.{e}.{proj}.weight", half[e]) for e in experts
                for proj, half in (("gate_proj", gate), ("up_proj", up))]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int | None]) -> None:
        expert, block = shard_id
        local = expert - self.first_expert
        if not 0 <= local < self.num_local:
            return  # another rank's expert
        target = param.data[local]
        if block is not None:
            rows = self.intermediate_size
            target = target.narrow(0, block * rows, rows)
        check_shape(target, loaded)
        target.copy_(loaded)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> [T, H]."""
        weights, ids = route(router_logits, self.top_k, self.renormalize)
        flat_ids = ids.flatten()  # [T * k]; assignment j belongs to token j // k
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        sorted_x = x[tokens]  # [T * k, H], grouped by expert
        out = torch.zeros_like(sorted_x)
        start = sum(counts[: self.first_expert])
        for local in range(self.num_local):  # one batched matmul pair per expert, never per token
            count = counts[self.first_expert + local]
            if count:
                rows = slice(start, start + count)
                gate, up = F.linear(sorted_x[rows], self.w13_weight[local]).chunk(2, dim=-1)
                out[rows] = F.linear(F.silu(gate) * up, self.w2_weight[local])
                start += count
        out *= weights.flatten()[order].unsqueeze(1)
        y = torch.zeros_like(x).index_add_(0, tokens, out)
        return tensor_model_parallel_all_reduce(y) if self.tp_size > 1 else y
