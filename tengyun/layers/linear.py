"""Linear layers that shard their own weights for tensor parallelism.

Column-parallel splits the output dim across TP ranks, row-parallel the input dim (and
all-reduces). Merged layers (qkv, gate_up) take each HF checkpoint tensor as a shard.

Every tensor a layer holds is described by a TensorLayout (tengyun/quantization/scheme.py): the
dense ``weight`` [out, in] and ``bias`` [out], or a quantised scheme's packed weight, scales and
zeros (``use_quant_scheme``). One loader places them all: along each tensor's OUT dim the layer
says which output features this rank keeps (``_out_parts``), along its IN dim which inputs
(``_in_part``), counted in features and divided by the tensor's features per element.

A fused layer whose checkpoint modules are stored in different schemes (a GGUF's Q4_K_M: a Q6_K
v_proj beside Q4_K q_proj and k_proj) holds each as a child ``LinearShard`` in ``shards``
(``use_shard_schemes``), run one after another and concatenated, as vLLM's GGUF linear does.
"""

from __future__ import annotations

import torch
from torch import nn

from tengyun.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from tengyun.layers.kernels import KernelBundle
from tengyun.layers.linear_kernel import DenseLinearKernel
from tengyun.layers.quant_kernels import reference_kernel
from tengyun.layers.weight_loading import (
    WeightFormatError, check_dropped, check_integer_dtype, check_shape, deferred_weights, layout_dtype, materialize,
    set_weight_loader, weight_device,
)
from tengyun.quantization.scheme import BIAS, DENSE_WEIGHT, IN, OUT, LinearScheme, TensorLayout

OutParts = tuple[list[tuple[int, int, int]], int]  # ([(param start, count, checkpoint start)], checkpoint total)


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by --tensor-parallel-size {denominator}.")
    return numerator // denominator


class LinearBase(nn.Module):
    """``input_size`` x ``output_size``: this rank's features; ``input_total``: all ranks' inputs."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 input_total: int | None = None):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.in_features, self.out_features = input_size, output_size
        self.in_total = input_total or input_size
        self.params_dtype = dtype
        self.scheme: LinearScheme | None = None  # set by use_quant_scheme
        self._shared_loaded: set[str] = set()  # tensors without an output dim loaded once already (g_idx)
        self._add_tensor(DENSE_WEIGHT, weight_device())  # meta until the worker knows the quantisation
        if bias:
            self._add_tensor(BIAS, weight_device())
        else:
            self.register_parameter("bias", None)
        self.kernel = DenseLinearKernel()  # the platform's once bound (bind_kernels)
        self.kernel_weight = None  # the kernel's form of the weight (a dict when quantised), once bound
        self.shards: nn.ModuleList | None = None  # LinearShard per checkpoint module (use_shard_schemes)
        self.lora = None  # LinearLoRA (layers/lora/layer.py) once the worker gives this layer adapter slots

    def _add_tensor(self, layout: TensorLayout, device: torch.device | None = None) -> None:
        shape = layout.shape(self.out_features, self.in_features if layout.split_in else self.in_total)
        param = nn.Parameter(torch.empty(shape, dtype=layout_dtype(layout, self.params_dtype), device=device),
                             requires_grad=False)
        param.tensor_layout = layout  # type: ignore[attr-defined]
        set_weight_loader(param, self.weight_loader)
        self.register_parameter(layout.name, param)

    # ----- where this rank's part of a checkpoint tensor lies, in features -------------------
    def _out_parts(self, shard_id) -> OutParts:
        return [(0, self.out_features, 0)], self.out_features

    def _in_part(self) -> tuple[int, int]:
        """(first input feature, count) this rank holds of in_total."""
        return 0, self.in_features

    def _shard_out_counts(self) -> list[int]:
        """Output features of every shard this rank places (each must hold whole packed elements)."""
        return [self.out_features]

    def _shard_ids(self) -> list:
        """The checkpoint modules fused into this layer, in output order, as the loader names them."""
        return [None]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        layout: TensorLayout = param.tensor_layout  # type: ignore[attr-defined]
        parts, out_total = self._out_parts(shard_id)
        check_shape(torch.empty(layout.shape(out_total, self.in_total), device="meta"), loaded)
        if self.scheme is not None:
            check_integer_dtype(param, loaded, layout, self.scheme.description)
        if not layout.kept:  # weight_shape (the dense shape this shard stands for), GPTQ's trivial g_idx, ...
            check_dropped(layout, loaded, self.scheme, out_total, self.in_total)
            return
        in_axis = layout.axis(IN)
        if in_axis and layout.split_in and self.in_features != self.in_total:
            start, count = self._in_part()
            loaded = loaded.narrow(in_axis[0], start // in_axis[1], count // in_axis[1])
        out_axis = layout.axis(OUT)
        if out_axis is None:  # GPTQ's g_idx: one for all the modules fused into this layer
            if shard_id is not None and layout.name in self._shared_loaded \
                    and not torch.equal(param.data, loaded.to(param.dtype)):  # as held: param may be cast
                raise WeightFormatError(f"differs from the {layout.name} of another module fused into this layer: "
                                        f"Tengyun (as vLLM) runs them as one layer holding one {layout.name}; "
                                        f"quantize them with one act order (GPTQ does, from their shared input)")
            param.data.copy_(loaded)
            self._shared_loaded.add(layout.name)
            return
        dim, per = out_axis
        for dst, count, src in parts:
            param.data.narrow(dim, dst // per, count // per).copy_(loaded.narrow(dim, src // per, count // per))

    # ----- quantisation -------------------------------------------------------------------------
    def use_quant_scheme(self, scheme: LinearScheme, name: str, device: torch.device | None = None) -> None:
        """Hold ``scheme``'s tensors, on ``device`` (default: the dense weight's), instead of the
        dense weight (before loading). ``name``: the layer's name, for the error when its shape
        (this rank's part) cannot hold the scheme."""
        for out in self._shard_out_counts():
            problem = scheme.shape_problem(out, self.in_features)
            if problem:
                split = f" (this rank's part at --tensor-parallel-size {self.tp_size})" if self.tp_size > 1 else ""
                fix = "a smaller --tensor-parallel-size, or " if self.tp_size > 1 else ""
                raise ValueError(f"{name}: {scheme.description} cannot hold {out} x {self.in_features} "
                                 f"features{split}: {problem}; use {fix}a checkpoint quantised with a group size "
                                 f"that divides them.")
        device = device or self.weight.device
        del self.weight
        for layout in scheme.tensors:
            self._add_tensor(layout, device)
            getattr(self, layout.name).described_as = scheme.description  # named in loading errors
        self.scheme = scheme
        self.kernel = reference_kernel(scheme)

    def use_shard_schemes(self, schemes: list[LinearScheme | None], name: str, device: torch.device) -> None:
        """Hold each fused checkpoint module in its own scheme (None: dense), one per
        ``_shard_ids()``, as ``shards`` (before loading; the bias stays here, fused)."""
        del self.weight
        shards = []
        for index, (shard_id, scheme) in enumerate(zip(self._shard_ids(), schemes, strict=True)):
            with deferred_weights():
                shard = LinearShard(self, shard_id)
            if scheme is None:
                materialize(shard, device)
            else:
                shard.use_quant_scheme(scheme, f"{name}.shards.{index}", device)
            shards.append(shard)
        self.shards = nn.ModuleList(shards)

    def _quant_tensors(self) -> dict[str, torch.Tensor]:
        return {t.name: getattr(self, t.name).data for t in self.scheme.tensors if t.kept}

    def bind_kernels(self, kernels: KernelBundle) -> None:
        """Hand the loaded weight to the linear kernel; a repacking kernel frees the original."""
        if self.shards is not None:  # each shard binds its own (it is a module of the model too)
            return
        if self.scheme is not None:
            self._bind_quant_kernel(kernels)
            return
        kernel = self.kernel = kernels.linear
        self.kernel_weight = kernel.prepare(self.weight.data)
        if kernel.frees_original:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def _bind_quant_kernel(self, kernels: KernelBundle) -> None:
        kernel = self.kernel = kernels.quant_linear.get(self.scheme) or reference_kernel(self.scheme)
        self.kernel_weight = kernel.prepare(self._quant_tensors())
        for layout in self.scheme.tensors:
            if kernel.frees_original or not layout.kept:
                param = getattr(self, layout.name)
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def _weight(self):
        if self.kernel_weight is not None:
            return self.kernel_weight
        return self.weight if self.scheme is None else self._quant_tensors()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shards is not None:  # [..., in] -> each shard's [..., rows], in the fused order
            y = torch.cat([shard(x) for shard in self.shards], dim=-1)
            y = y if self.bias is None else y + self.bias
        else:
            y = self.kernel.apply(x, self._weight(), self.bias)
        return y if self.lora is None else self.lora.add(x, y)


class LinearShard(LinearBase):
    """One checkpoint module of a fused layer, held in its own scheme: the fused layer's output
    rows [offset, offset + rows) on this rank, loaded as the fused layer would load them."""

    def __init__(self, fused: LinearBase, shard_id):
        ((_, rows, start),), total = fused._out_parts(shard_id)  # where the fused layer places it
        self.shard_id, self._parts = shard_id, ([(0, rows, start)], total)  # read by _add_tensor, _out_parts
        super().__init__(fused.in_features, rows, False, fused.params_dtype)

    def _add_tensor(self, layout: TensorLayout, device: torch.device | None = None) -> None:
        super()._add_tensor(layout, device)
        getattr(self, layout.name).shard_ids = [self.shard_id]  # the loader plans this shard only

    def _out_parts(self, shard_id) -> OutParts:
        return self._parts


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's rows (outputs) split across ranks: [out / tp, in] per rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype):
        tp = get_tp_size()
        super().__init__(input_size, _divide(output_size, tp, "output size"), bias, dtype)

    def _out_parts(self, shard_id) -> OutParts:
        rows = self.out_features
        return [(0, rows, self.tp_rank * rows)], rows * self.tp_size


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored as one weight, e.g. gate_up = [gate; up]. Each output
    is split over the ranks; the checkpoint holds them as separate tensors (shard_id = their index)
    or as one tensor back to back (shard_id None, e.g. Qwen3.5's in_proj_qkv: q | k | v)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, dtype)

    def _out_parts(self, shard_id) -> OutParts:
        tp, rank, sizes = self.tp_size, self.tp_rank, self.output_sizes
        if shard_id is None:  # every output back to back: this rank's 1/tp of each
            return [(sum(sizes[:i]) // tp, size // tp, sum(sizes[:i]) + rank * (size // tp))
                    for i, size in enumerate(sizes)], sum(sizes)
        rows = sizes[shard_id] // tp
        return [(sum(sizes[:shard_id]) // tp, rows, rank * rows)], sizes[shard_id]

    def _shard_out_counts(self) -> list[int]:
        return [size // self.tp_size for size in self.output_sizes]

    def _shard_ids(self) -> list:
        return list(range(len(self.output_sizes)))


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

    def _out_parts(self, shard_id: str) -> OutParts:
        q_rows = self.num_heads * self.head_size
        kv_rows = self.num_kv_heads * self.head_size
        if shard_id == "q":
            return [(0, q_rows, self.tp_rank * q_rows)], q_rows * self.tp_size
        offset = q_rows if shard_id == "k" else q_rows + kv_rows
        start = (self.tp_rank // self.kv_replicas) * kv_rows
        return [(offset, kv_rows, start)], self.total_num_kv_heads * self.head_size

    def _shard_out_counts(self) -> list[int]:
        return [self.num_heads * self.head_size, self.num_kv_heads * self.head_size]

    def _shard_ids(self) -> list:
        return ["q", "k", "v"]


class RowParallelLinear(LinearBase):
    """y = x W^T with W's columns (inputs) split across ranks; partial sums all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype):
        tp = get_tp_size()
        super().__init__(_divide(input_size, tp, "input size"), output_size, bias, dtype, input_total=input_size)

    def _in_part(self) -> tuple[int, int]:
        return self.tp_rank * self.in_features, self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel.apply(x, self._weight(), None)
        if self.lora is not None:  # each rank's partial B A x, summed by the all-reduce with the rest
            y = self.lora.add(x, y)
        if self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        return y if self.bias is None else y + self.bias
