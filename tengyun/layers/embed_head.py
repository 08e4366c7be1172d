"""Vocab-parallel embedding and LM head: each TP rank holds a contiguous slice of the vocab.

Either holds a dense ``weight`` [vocab / tp, hidden], or (a GGUF kept quantised, whose
token_embd / output tensors are blocks: QuantConfig.vocab_layers, as vLLM's GGUF embedding and
head) its scheme's ``qweight`` [vocab / tp, hidden / block, block bytes], rows by token; or (an
untied head a compressed-tensors checkpoint targets by name: QuantConfig.head_scheme) that
scheme's tensors, weight_packed [vocab / tp, hidden * bits / 32] and weight_scale [vocab / tp,
groups], or W8A8's int8 weight and weight_scale [vocab / tp, 1]. A quantised embedding looks
tokens up by dequantizing their rows; a quantised head multiplies through the platform's quant
kernel where that kernel streams the quantised weight (else a weight-only head is dequantized
once at bind and runs dense, as before: the same logits; a W8A8 head, whose activations are
quantised too, keeps the reference kernel).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tengyun.distributed.parallel_state import (
    get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce, tensor_model_parallel_gather,
)
from tengyun.layers.kernels import KernelBundle
from tengyun.layers.linear_kernel import DenseLinearKernel, RowReader
from tengyun.layers.quant_kernels import dequantize_unpacked, reference_kernel, unpacked_weight
from tengyun.layers.weight_loading import (
    check_dropped, check_integer_dtype, check_shape, layout_dtype, set_weight_loader,
)
from tengyun.quantization.config import QuantizationError
from tengyun.quantization.scheme import OUT, LinearScheme

logger = logging.getLogger(__name__)

_DEQUANTIZE_ROWS = 8192  # rows dequantized at a time when a quantised head turns dense at bind


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size, self.hidden_size, self.params_dtype = vocab_size, hidden_size, dtype
        self.shard_size = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size, dtype=dtype), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        self.scheme: LinearScheme | None = None  # set by use_quant_scheme
        # local ids -> rows where they are not read by F.embedding from ``weight``: a quantised
        # embedding's blocks or its kernel's layout of them, or a tied LM head kernel's copy
        # (then the only copy; ParallelLMHead).
        self.row_reader: RowReader | None = None
        self.kernel_weight = None  # the quant kernel's layout the row reader reads, when it has one
        self.head_tied = False  # a ParallelLMHead shares this weight (it binds the kernels for both)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        layout = getattr(param, "tensor_layout", None)
        if layout is not None and not layout.kept:  # compressed-tensors' weight_shape: checked, then dropped
            check_shape(torch.empty(layout.shape(self.vocab_size, self.hidden_size), device="meta"), loaded)
            check_dropped(layout, loaded, self.scheme, self.vocab_size, self.hidden_size, "LM head")
            return
        check_shape(torch.empty((self.vocab_size, *param.shape[1:]), device="meta"), loaded)
        if self.scheme is not None:
            check_integer_dtype(param, loaded, layout, self.scheme.description)
        rows = min(self.shard_size, self.vocab_size - self.vocab_start)
        param.data.zero_()  # padding rows of the last shard: zero (zero blocks dequantize to 0)
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))

    # ----- quantised rows (GGUF) ------------------------------------------------------------------
    def use_quant_scheme(self, scheme: LinearScheme, name: str, device: torch.device | None = None) -> None:
        """Hold ``scheme``'s tensors instead of ``weight`` (before loading): each it keeps must run
        over the vocab along dim 0, one row per token, as a GGUF's blocks do."""
        if any(t.axis(OUT) != (0, 1) for t in scheme.tensors if t.kept):
            raise QuantizationError(f"{name}: {scheme.description} does not store one row per token (an "
                                    f"asymmetric checkpoint's zero points pack several); Tengyun keeps an LM head "
                                    f"quantised with symmetric weights only: add {name} to the ignore list.")
        problem = scheme.shape_problem(self.shard_size, self.hidden_size)
        if problem:
            raise ValueError(f"{name}: {scheme.description} cannot hold {self.vocab_size} x {self.hidden_size}: "
                             f"{problem}.")
        device = device or self.weight.device
        del self.weight
        for layout in scheme.tensors:
            shape = layout.shape(self.shard_size, self.hidden_size) if layout.kept else (0,)
            param = nn.Parameter(torch.empty(shape, dtype=layout_dtype(layout, self.params_dtype), device=device),
                                 requires_grad=False)
            param.tensor_layout, param.described_as = layout, scheme.description  # type: ignore[attr-defined]
            set_weight_loader(param, self.weight_loader)
            self.register_parameter(layout.name, param)
        self.scheme = scheme

    def quant_tensors(self) -> dict[str, torch.Tensor]:
        return {t.name: getattr(self, t.name).data for t in self.scheme.tensors if t.kept}

    def dequantized(self) -> torch.Tensor:
        """The quantised rows as a dense [vocab / tp, hidden] weight in params_dtype."""
        read = reference_kernel(self.scheme).row_reader(self.quant_tensors(), self.params_dtype)
        if read is None:  # a compressed-tensors head: all of it at once
            return dequantize_unpacked(unpacked_weight(self.quant_tensors(), self.scheme), self.params_dtype)
        ids = torch.arange(self.shard_size, device=self.quant_tensors()[self.scheme.tensors[0].name].device)
        return torch.cat([read(chunk) for chunk in ids.split(_DEQUANTIZE_ROWS)])

    def bind_kernels(self, kernels: KernelBundle) -> None:
        """A quantised embedding reads its rows from the platform's kernel layout where that kernel
        reads rows (the CPU compiled layout: same bytes as Q8_0 / Q4_0 / Q4_1 blocks, a decode
        graph can trace it), else from its blocks. A tied one: its head decides (ParallelLMHead)."""
        if self.scheme is None:
            return
        self.row_reader = reference_kernel(self.scheme).row_reader(self.quant_tensors(), self.params_dtype)
        kernel = kernels.quant_linear.get(self.scheme)
        if self.head_tied or kernel is None or not (kernel.frees_original and kernel.streams_quantised):
            return  # (a kernel that holds its weight dense, Q6_K's on CPU, is no place to read rows from)
        prepared = kernel.prepare(self.quant_tensors())
        reader = kernel.row_reader(prepared, self.params_dtype)
        if reader is not None:
            self.row_reader, self.kernel_weight = reader, prepared
            for layout in self.scheme.tensors:
                param = getattr(self, layout.name)
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        read = self.row_reader
        if read is None and self.scheme is not None:  # not bound yet (a model built outside the worker)
            read = reference_kernel(self.scheme).row_reader(self.quant_tensors(), self.params_dtype)
        if read is None:
            return F.embedding(ids, self.weight)
        # (a shape tuple: view(*shape) of one size would trace as view(dtype), breaking decode graphs)
        return read(ids.reshape(-1)).reshape((*ids.shape, -1))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._rows(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        y = self._rows(local.masked_fill(outside, 0))
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
        embedding.head_tied = True

    def use_quant_scheme(self, scheme: LinearScheme, name: str, device: torch.device | None = None) -> None:
        """A tied head shares its (already quantised) embedding's tensors; an untied one holds its own."""
        if self.tied_embedding:
            embedding = self.tied_embedding[0]
            del self.weight
            for layout in embedding.scheme.tensors:
                self.register_parameter(layout.name, getattr(embedding, layout.name))
            self.scheme = embedding.scheme
        else:
            super().use_quant_scheme(scheme, name, device)
        self.kernel = reference_kernel(self.scheme)

    def bind_kernels(self, kernels: KernelBundle) -> None:
        """Hand the weight to the linear kernel. A repacking kernel frees the original (an untied
        head would otherwise hold its weight twice); a tied one too where the kernel's copy reads
        back every row exactly and so serves the embedding's lookups (dense: at TP = 1)."""
        if self.scheme is not None:
            if self._bind_quant_kernel(kernels):
                return
            self._turn_dense()
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

    def _bind_quant_kernel(self, kernels: KernelBundle) -> bool:
        """Multiply through the platform's kernel for the scheme where it streams the quantised
        weight (a tied embedding then reads its rows from that kernel's copy when it can). False:
        none does, and a dense copy computes the same logits (weight-only). A head whose activations
        are quantised too (W8A8) keeps its kernel, the reference where the platform has none."""
        kernel = kernels.quant_linear.get(self.scheme)
        weight_only = not self.scheme.quantises_activations
        if kernel is None and not weight_only:
            kernel = reference_kernel(self.scheme)
        if kernel is None or (weight_only and not kernel.streams_quantised):
            return False
        prepared = kernel.prepare(self.quant_tensors())
        if weight_only and not kernel.streams(prepared):
            return False
        self.kernel, self.kernel_weight = kernel, prepared
        logger.info("LM head kept quantised: %s through %s", self.scheme.description, type(kernel).__name__)
        if not kernel.frees_original:
            return True
        if self.tied_embedding:
            reader = kernel.row_reader(self.kernel_weight, self.params_dtype)
            if reader is None:
                return True  # the embedding keeps reading its blocks: two copies
            self.tied_embedding[0].row_reader = reader
        for layout in self.scheme.tensors:  # shared with a tied embedding, which reads the kernel's copy now
            param = getattr(self, layout.name)
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        return True

    def _turn_dense(self) -> None:
        """No kernel here multiplies the blocks faster than a dense weight would: dequantize once
        (a tied embedding with it, so the two share one dense weight again, as when the .gguf
        was loaded dequantized)."""
        logger.info("LM head: %s dequantized once to %s (no kernel here multiplies its blocks faster than a "
                    "dense weight)%s", self.scheme.description, str(self.params_dtype).removeprefix("torch."),
                    ", the tied embedding with it" if self.tied_embedding else "")
        dense = nn.Parameter(self.dequantized(), requires_grad=False)
        for layout in self.scheme.tensors:
            delattr(self, layout.name)
        self.scheme, self.weight = None, dense
        if self.tied_embedding:
            embedding = self.tied_embedding[0]
            for layout in embedding.scheme.tensors:
                delattr(embedding, layout.name)
            embedding.scheme, embedding.row_reader, embedding.weight = None, None, dense
            embedding.kernel_weight = None

    def _weight(self):
        if self.kernel_weight is not None:
            return self.kernel_weight
        return self.weight if self.scheme is None else self.quant_tensors()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.kernel.apply(hidden, self._weight(), None)  # [N, vocab / tp] (padded shard)
        logits = tensor_model_parallel_gather(logits)  # [N, padded vocab] on TP rank 0
        return None if logits is None else logits[:, : self.vocab_size]
