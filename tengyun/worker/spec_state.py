"""RecurrentStateSnapshots: hybrid models' rollback of rejected speculative drafts.

A Gated DeltaNet layer folds every token it sees into its sequence's state slot, so after a
verification step the state includes the drafts, rejected ones too. Before such a step the
slots of the verifying sequences are copied; when a sequence's drafts are not all accepted its
copy is put back, and the scheduler counts none of the step's tokens as computed
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
        self.saved: dict[int, list[torch.Tensor]] = {}  # slot -> copies of its rows, one per state tensor

    def save(self, slots: list[int]) -> None:
        """Copy these slots' conv and SSM state rows (before the step that verifies their drafts)."""
        self.saved = {}
        if not slots or not self.layers:
            return
        index = torch.tensor(slots, device=self.layers[0].ssm_state.device)
        copies = [t.index_select(0, index) for layer in self.layers for t in (layer.conv_state, layer.ssm_state)]
        self.saved = {slot: [c[i] for c in copies] for i, slot in enumerate(slots)}

    def restore(self, slot: int) -> None:
        """Put slot's saved rows back: its state is again that of before the verification step."""
        tensors = [t for layer in self.layers for t in (layer.conv_state, layer.ssm_state)]
        for tensor, saved in zip(tensors, self.saved[slot]):
            tensor[slot] = saved
