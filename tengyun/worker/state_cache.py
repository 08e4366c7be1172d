"""Allocates the recurrent-state pool of hybrid models and binds each Gated DeltaNet layer to it."""

from __future__ import annotations

import torch
from torch import nn

from tengyun.kv_sizing import StateShape
from tengyun.layers.gated_delta_net import GatedDeltaNet


def allocate_state_cache(model: nn.Module, shape: StateShape, num_slots: int, dtype: torch.dtype,
                         device: torch.device) -> list[torch.Tensor]:
    """Per layer: conv state [num_slots, conv_dim, K - 1] (dtype), SSM state [num_slots, Hv, Dk, Dv]
    (float32). Rows are not zeroed between sequences: a sequence's first chunk starts from zeros."""
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    assert len(layers) == shape.num_layers, f"{len(layers)} Gated DeltaNet layers, {shape.num_layers} expected"
    tensors = []
    for layer in layers:
        layer.conv_state = torch.zeros(num_slots, shape.conv_dim, shape.conv_width, dtype=dtype, device=device)
        layer.ssm_state = torch.zeros(num_slots, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim,
                                      dtype=torch.float32, device=device)
        tensors += [layer.conv_state, layer.ssm_state]
    return tensors
