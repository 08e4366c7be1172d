"""Vocab-parallel embedding and LM head: each TP rank holds a contiguous slice of the vocab."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tengyun.distributed.parallel_state import (
    get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce, tensor_model_parallel_gather,
)
from tengyun.layers.kernels import KernelBundle
from tengyun.layers.linear_kernel import DenseLinearKernel, RowReader
from tengyun.layers.weight_loading import check_shape, set_weight_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size, dtype=dtype), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        # Where a tied LM head's kernel holds the only copy of the weight (weight then empty):
        # ids -> rows from that copy, bit for bit what F.embedding would return (ParallelLMHead).
        self.row_reader: RowReader | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        check_shape(torch.empty((self.vocab_size, param.shape[1]), device="meta"), loaded)
        rows = min(self.shard_size, self.vocab_size - self.vocab_start)
        param.data.zero_()
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.row_reader is not None:  # TP = 1 only (ParallelLMHead.bind_kernels)
            return self.row_reader(input_ids)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y.masked_fill_(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states [N, hidden] to logits [N, vocab], gathered on TP rank 0 only
    (the rank that samples); the other TP ranks get None."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__(vocab_size, hidden_size, dtype)
        self.kernel = DenseLinearKernel()
        self.kernel_weight = None
        self.tied_embedding: list[VocabParallelEmbedding] = []  # [the embedding] whose weight this is (tie_to)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share ``embedding``'s weight (a list: not a submodule, the model holds it already)."""
        self.weight = embedding.weight
        self.tied_embedding = [embedding]

    def bind_kernels(self, kernels: KernelBundle) -> None:
        """Hand the weight to the linear kernel. A repacking kernel frees the original (an untied
        head would otherwise hold its weight twice); a tied one too where, at TP = 1, the kernel's
        copy reads back every row exactly and so serves the embedding's lookups."""
        self.kernel = kernels.linear
        self.kernel_weight = self.kernel.prepare(self.weight.data)
        if not self.kernel.frees_original:
            return
        if self.tied_embedding:
            reader = self.kernel.row_reader(self.kernel_weight, self.weight.data) if self.tp_size == 1 else None
            if reader is None:
                return  # the embedding keeps the plain weight: two copies
            self.tied_embedding[0].row_reader = reader
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        weight = self.weight if self.kernel_weight is None else self.kernel_weight
        logits = self.kernel.apply(hidden, weight, None)  # [N, vocab / tp] (padded shard)
        logits = tensor_model_parallel_gather(logits)  # [N, padded vocab] on TP rank 0
        return None if logits is None else logits[:, : self.vocab_size]
