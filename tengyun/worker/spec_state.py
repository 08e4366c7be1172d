"""RecurrentStateSnapshots: hybrid models' rollback of rejected speculative drafts.

A Gated DeltaNet layer folds every token it sees into its sequence's state slot, so after a
verification step the state includes the drafts, rejected ones too. Before such a step each
verifying sequence's slot is copied into a spare slot of the pool the scheduler lent it for the
step (CachedSeqData.backup_state_slot: no memory beyond the pool); when its drafts are not all
accepted the copy is put back, and the scheduler counts none of the step's tokens as computed
(Scheduler.advance), so the next step recomputes the last token and the accepted drafts from
the restored state. (Accepted drafts are thus computed twice on a rejection; keeping a state per
draft position, as vLLM does, would avoid that at K times the state memory.)
"""

from __future__ import annotations

import torch
from torch import nn

from tengyun.layers.gated_delta_net import GatedDeltaNet


class RecurrentStateSnapshots:
    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
        self.backup_of: dict[int, int] = {}  # slot -> the spare slot holding its copy this step

    def _tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in (layer.conv_state, layer.ssm_state)]

    def save(self, slots: list[int], backups: list[int]) -> None:
        """Copy each slot's conv and SSM state rows into its backup slot (before the step that
        verifies the sequences' drafts)."""
        self.backup_of = dict(zip(slots, backups))
        if not slots or not self.layers:
            return
        device = self.layers[0].ssm_state.device
        src, dst = torch.tensor(slots, device=device), torch.tensor(backups, device=device)
        for tensor in self._tensors():
            tensor.index_copy_(0, dst, tensor.index_select(0, src))

    def restore(self, slot: int) -> None:
        """Put slot's copy back: its state is again that of before the verification step."""
        backup = self.backup_of[slot]
        for tensor in self._tensors():
            tensor[slot] = tensor[backup]
