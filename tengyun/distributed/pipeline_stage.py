"""This process's pipeline stage, as the model runner sees it: receive activations from the
previous stage, send them to the next. With one stage both are no-ops."""

from __future__ import annotations

import torch

from tengyun.distributed.parallel_state import is_first_pp_rank, is_last_pp_rank, pp_recv, pp_send


class PipelineStage:
    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.is_first = is_first_pp_rank()
        self.is_last = is_last_pp_rank()

    def receive(self, num_tokens: int) -> list[torch.Tensor] | None:
        """[hidden, residual], each [T, hidden], from the previous stage; None on the first stage."""
        if self.is_first:
            return None
        shape = (num_tokens, self.hidden_size)
        return pp_recv([shape, shape], self.dtype, self.device)

    def send(self, tensors: list[torch.Tensor]) -> None:
        pp_send(tensors)
