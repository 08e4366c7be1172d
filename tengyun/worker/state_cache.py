"""Allocates the recurrent-state pool of hybrid models and binds each Gated DeltaNet layer to it."""

from __future__ import annotations

import torch
from torch import nn

from tengyun.sizing.cache import StateShape
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


def release_state_cache(model: nn.Module) -> None:
    """Every Gated DeltaNet layer unbound from its state rows (as built), so that they can be freed."""
    for layer in model.modules():
        if isinstance(layer, GatedDeltaNet):
            layer.conv_state, layer.ssm_state = torch.empty(0), torch.empty(0)


class StateSnapshotRows:
    """Hybrid prefix caching (engine/state_snapshots.py): copies every Gated DeltaNet layer's conv
    and SSM state between running slots and snapshot rows. Snapshot row r is row
    ``snapshot_base + r`` of the same tensors, after the running slots (and the decode graphs'
    padding slot)."""

    def __init__(self, tensors: list[torch.Tensor], snapshot_base: int):
        self.tensors = tensors
        self.snapshot_base = snapshot_base

    def restore(self, pairs: list[tuple[int, int]]) -> None:
        """(snapshot row, slot) pairs: before the model runs, each slot starts from its snapshot."""
        self._copy([self.snapshot_base + row for row, _ in pairs], [slot for _, slot in pairs])

    def save(self, pairs: list[tuple[int, int]]) -> None:
        """(slot, snapshot row) pairs: after the model ran, keep each slot's state in its row."""
        self._copy([slot for slot, _ in pairs], [self.snapshot_base + row for _, row in pairs])

    def _copy(self, src: list[int], dst: list[int]) -> None:
        """Row by row: each row is one contiguous block (a layer's SSM state is Hv x Dk x Dv floats),
        and a step copies a few rows; on CPU index_select + index_copy_ over the same rows ran 100x
        slower (its parallel path stalls when other processes hold the cores)."""
        for tensor in self.tensors:
            for s, d in zip(src, dst):
                tensor[d].copy_(tensor[s])
