"""Linear layers that shard their own weights for tensor parallelism.

Column-parallel splits the output dim across TP ranks, row-parallel the input dim (and
all-reduces). Merged layers (qkv, gate_up) take each HF checkpoint tensor as a shard.
"""

from __future__ import annotations

import torch
from torch import nn

from tengyun.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from tengyun.layers.kernels import KernelBundle
from tengyun.layers.linear_kernel import DenseLinearKernel
from tengyun.layers.weight_loading import check_shape, rank_slice_of_segments, set_weight_loader


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by --tensor-parallel-size {denominator}.")
    return numerator // denominator


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)
        self.kernel = DenseLinearKernel()  # the platform's once bound (bind_kernels)
        self.kernel_weight: torch.Tensor | None = None  # the kernel's form of weight, once loaded

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        check_shape(param.data, loaded)
        param.data.copy_(loaded)

    def bind_kernels(self, kernels: KernelBundle) -> None:
        """Hand the loaded weight to the linear kernel; a repacking kernel frees the original."""
        kernel = self.kernel = kernels.linear
        self.kernel_weight = kernel.prepare(self.weight.data)
        if kernel.frees_original:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def _weight(self) -> torch.Tensor:
        return self.weight if self.kernel_weight is None else self.kernel_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.apply(x, self._weight(), self.bias)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's rows (outputs) split across ranks: [out / tp, in] per rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype):
        tp = get_tp_size()
        super().__init__(input_size, _divide(output_size, tp, "output size"), bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = param.shape[0]
        full = (rows * self.tp_size,) + tuple(param.shape[1:])
        check_shape(torch.empty(full, device="meta"), loaded)
        param.data.copy_(loaded.narrow(0, self.tp_rank * rows, rows))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored as one weight, e.g. gate_up = [gate; up]. Each output
    is split over the ranks; the checkpoint holds them as separate tensors (shard_id = their index)
    or as one tensor back to back (shard_id None)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:  # one checkpoint tensor holding every output, e.g. Qwen3.5's in_proj_qkv
            part = rank_slice_of_segments(loaded, self.output_sizes, self.tp_rank, self.tp_size)
            check_shape(param.data, part)
            param.data.copy_(part)
            return
        shard_rows = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        full = (self.output_sizes[shard_id],) + tuple(param.shape[1:])
        check_shape(torch.empty(full, device="meta"), loaded)
        param.data.narrow(0, offset, shard_rows).copy_(loaded.narrow(0, self.tp_rank * shard_rows, shard_rows))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one weight: [(Hq + 2 * Hkv) * D / tp, hidden] per rank.

    KV heads are split across ranks, or replicated when tp > num_kv_heads.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool, dtype: torch.dtype):
        tp = get_tp_size()
        self.head_size = head_size
        self.num_heads = _divide(total_num_heads, tp, "num_attention_heads")
        self.kv_replicas = max(1, tp // total_num_kv_heads)
        self.num_kv_heads = max(1, total_num_kv_heads // tp)
        self.total_num_kv_heads = total_num_kv_heads
        output = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp
        super().__init__(hidden_size, output, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_rows = self.num_heads * self.head_size
        kv_rows = self.num_kv_heads * self.head_size
        if shard_id == "q":
            offset, rows, full_rows, start = 0, q_rows, q_rows * self.tp_size, self.tp_rank * q_rows
        else:
            offset = q_rows if shard_id == "k" else q_rows + kv_rows
            rows, full_rows = kv_rows, self.total_num_kv_heads * self.head_size
            start = (self.tp_rank // self.kv_replicas) * kv_rows
        full = (full_rows,) + tuple(param.shape[1:])
        check_shape(torch.empty(full, device="meta"), loaded)
        param.data.narrow(0, offset, rows).copy_(loaded.narrow(0, start, rows))


class RowParallelLinear(LinearBase):
    """y = x W^T with W's columns (inputs) split across ranks; partial sums all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype):
        tp = get_tp_size()
        super().__init__(_divide(input_size, tp, "input size"), output_size, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # bias: added once, after the reduce
            check_shape(param.data, loaded)
            param.data.copy_(loaded)
            return
        cols = param.shape[1]
        check_shape(torch.empty((param.shape[0], cols * self.tp_size), device="meta"), loaded)
        param.data.copy_(loaded.narrow(1, self.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel.apply(x, self._weight(), None)
        if self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        return y if self.bias is None else y + self.bias
