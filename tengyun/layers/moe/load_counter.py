"""Tokens routed to each expert of each MoE layer (--enable-expert-load-metrics).

Each FusedMoE layer adds its step's per-expert counts into its row of one device tensor
(``FusedMoE.expert_load``, a view); the runner reads the whole tensor once per step output
(``take``: one device-to-host copy, however many layers) and zeroes it. Counts are of the
router's top-k picks, so a token counts once per expert it was routed to (k per token per layer),
and every rank holds the same (the router is replicated); the sampling rank reports them.
"""

from __future__ import annotations

import torch
from torch import nn

from tengyun.layers.fused_moe import FusedMoE


def moe_layers(model: nn.Module) -> list[tuple[int, FusedMoE]]:
    """(decoder layer index, its experts) of every MoE layer: 'model.layers.3.mlp.experts' -> 3."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            index = next((int(p) for p in reversed(name.split(".")) if p.isdigit()), len(found))
            found.append((index, module))
    return found


class ExpertLoadCounter:
    def __init__(self, model: nn.Module, device: torch.device):
        self.layers = moe_layers(model)
        num_experts = max((layer.num_experts for _, layer in self.layers), default=0)
        self.counts = torch.zeros(len(self.layers), num_experts, dtype=torch.int64, device=device)  # [L, E]
        for row, (_, layer) in enumerate(self.layers):
            layer.expert_load = self.counts[row, :layer.num_experts]

    def take(self) -> list[tuple[int, int, int]]:
        """(layer index, expert, tokens) of each nonzero count since the last take; zeroes them."""
        counts = self.counts.to("cpu", copy=True)  # the one host read (a copy: zeroed next, even on CPU)
        self.counts.zero_()
        rows, experts = counts.nonzero(as_tuple=True)
        return [(self.layers[r][0], e, n) for r, e, n in zip(rows.tolist(), experts.tolist(),
                                                             counts[rows, experts].tolist())]
