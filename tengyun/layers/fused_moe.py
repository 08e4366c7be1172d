"""Sparse mixture-of-experts: top-k softmax routing, the experts run as grouped matmuls.

How the experts are divided over the tensor-parallel ranks (each rank holds every token):
- by default (vLLM's), every rank holds a slice of every expert: rows [r * I / tp, (r + 1) * I / tp)
  of each expert's gate and up, the same columns of its down; the ranks' partial sums are all-reduced.
- with --enable-expert-parallel, experts are divided whole among the EP group (parallel_state: the
  TP ranks of the stage): rank r holds experts [r * E / ep, (r + 1) * E / ep) and computes only the
  tokens routed to them; the outputs are summed over the group (expert_parallel_combine). The
  loader never reads the other ranks' per-expert tensors.
- with --data-parallel-size as well, the EP group spans all replicas' ranks, and each MoE layer
  first gathers every replica's tokens and at the end sums each rank's share over the replicas
  (distributed/data_parallel.py); a replica with nothing to schedule still runs the exchanges.
Quantised experts are always divided whole (a quantised layout's groups may not split at I / tp).

Dense experts run through the platform's "moe" kernel (layers/moe/grouped.py: routing, tokens
sorted by expert, grouped matmuls, un-permute), with no host synchronisation.

Quantised experts (``use_quant_scheme``) stack each of the scheme's tensors per expert:
``w13_weight_packed`` [E_local, *layout of a 2I x H layer], ``w2_weight_scale`` [E_local, *layout
of an H x I layer], ...; at bind the platform's quantised linear kernel (layers/quant_kernels.py)
prepares each expert, and prepared tensors it made anew are stacked again, [E_local, ...]
(``kernel_weight``). Where the kernel runs such a stack as one grouped call (``groups_experts``),
the layer does (``quant_grouped``: grouped.grouped_experts, the ends of each expert's rows a device
tensor, no host read, graph-capturable):
- CPU, with the compiled kernels loaded: 4- and 8-bit weight-only in the compiled layout (bfloat16;
  compressed-tensors, AWQ, GPTQ without act order), W8A8 dynamic and msModelSlim static where the
  packed int8 kernel runs (AVX-512 VNNI; any float dtype), GGUF Q4_0 / Q4_1 / Q4_K / Q8_0 in the
  compiled layout and Q6_K held dequantized (bfloat16): one compiled call per stack loops over the
  experts in C++ (csrc/moe_grouped.cpp), each expert's rows as its per-expert call computes them.
- NPU: W8A8 dynamic (npu_dynamic_quant, then npu_grouped_matmul with scale and per_token_scale) and
  8-bit weight-only per channel (npu_grouped_matmul's antiquant_scale / antiquant_offset), bfloat16
  and float16 (platforms/npu/kernels/quant.py).
Everything else loops over the local experts (grouped.loop_experts: one kernel call per expert with
tokens, the per-expert counts read on the host once per layer, so not graph-capturable): GPTQ act
order, 4-bit or grouped weight-only on NPU, static W8A8 on NPU, float32 weight-only, torch's int4
layout (no compiled kernels), the references (CUDA).
w13 and w2 may hold different schemes (a GGUF Q4_K_M stores gate/up as Q4_K and down as Q6_K), or
one of them none (dense: torch._grouped_mm where the dense MoE kernel is PyTorch's, else the loop).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tengyun.distributed import data_parallel
from tengyun.distributed.parallel_state import (
    expert_parallel_combine, get_ep_rank, get_ep_size, get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce,
)
from tengyun.layers.kernels import KernelBundle
from tengyun.layers.moe.grouped import LoopMoe, TorchGroupedMoe, grouped_experts, grouped_mm, loop_experts
from tengyun.layers.quant_kernels import expert_view, reference_kernel
from tengyun.layers.weight_loading import (
    check_dropped, check_integer_dtype, check_shape, layout_dtype, set_weight_loader, weight_device,
)
from tengyun.quantization.scheme import OUT, LinearScheme, TensorLayout

# Checkpoint projection -> (stacked parameter prefix, row block inside it)
_SHARDS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}


class FusedMoE(nn.Module):
    """Experts stacked per rank: w13 [E_local, 2 * I_local, H] (gate rows, then up), w2 [E_local, H, I_local];
    E_local = E, I_local = I / tp (slices of every expert), or E_local = E / ranks, I_local = I (whole)."""

    # Until bound: PyTorch's grouped matmul (the loop where this torch has none).
    moe_kernel = TorchGroupedMoe() if hasattr(torch, "_grouped_mm") else LoopMoe()

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype):
        super().__init__()
        self.tp_size = get_tp_size()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.params_dtype, self.hidden_size, self.full_intermediate = dtype, hidden_size, intermediate_size
        self.expert_parallel = get_ep_size() > 1
        self._partition(whole=self.expert_parallel or self.tp_size == 1)
        self.schemes: dict[str, LinearScheme] = {}  # "w13" / "w2" -> its experts' scheme (absent: dense)
        self.kernels: dict[str, object] = {}  # "w13" / "w2" -> the quantised experts' kernel
        # -> the local experts' prepared tensors once bound: stacked [E_local, ...] (stack_experts), or a list
        self.kernel_weight: dict[str, dict | list] | None = None
        self.quant_grouped = False  # bound quantised experts run as grouped calls (no host read)
        # --enable-expert-load-metrics: [E] int64 on the device, tokens routed to each expert (moe/load_counter.py)
        self.expert_load: torch.Tensor | None = None
        self.across_replicas = data_parallel.active()  # the EP group spans the data-parallel replicas

    def _partition(self, whole: bool, device: torch.device | str | None = None) -> None:
        """Which experts and which slice of each this rank holds, and its dense w13 / w2 (on the meta
        device until the worker knows the quantisation). whole: E / ranks whole experts (the EP
        group's ranks, else the TP ranks); else all E experts, I / tp rows of each (split_rank's)."""
        ranks, rank = (get_ep_size(), get_ep_rank()) if self.expert_parallel else (self.tp_size, get_tp_rank())
        if whole and self.num_experts % ranks:
            raise ValueError(f"num_experts ({self.num_experts}) cannot be divided whole among {ranks} ranks "
                             f"(--tensor-parallel-size {self.tp_size}).")
        self.num_local = self.num_experts // ranks if whole else self.num_experts
        self.first_expert = rank * self.num_local if whole else 0
        self.intermediate_size = self.full_intermediate if whole else self.full_intermediate // self.tp_size
        self.split_rank = 0 if whole else rank  # this rank's slice of each expert's intermediate features
        hidden, inter, device = self.hidden_size, self.intermediate_size, device or weight_device()
        self.w13_weight = nn.Parameter(torch.empty(self.num_local, 2 * inter, hidden, dtype=self.params_dtype,
                                                   device=device), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.num_local, hidden, inter, dtype=self.params_dtype,
                                                  device=device), requires_grad=False)
        local = range(self.first_expert, self.first_expert + self.num_local)
        # What the loader must find for this rank: (expert id, row block) per stacked parameter.
        self.w13_weight.shard_ids = [(e, block) for e in local for block in (0, 1)]
        self.w2_weight.shard_ids = [(e, None) for e in local]
        set_weight_loader(self.w13_weight, self.weight_loader)
        set_weight_loader(self.w2_weight, self.weight_loader)
        self.w2_features = (hidden, inter)

    @staticmethod
    def checkpoint_name_to_param(name: str) -> tuple[str, tuple[int, int | None]] | None:
        """'...mlp.experts.5.up_proj.weight' -> ('...mlp.experts.w13_weight', (5, 1));
        '...experts.5.down_proj.weight_scale' -> ('...experts.w2_weight_scale', (5, None))."""
        prefix, sep, rest = name.partition(".experts.")
        parts = rest.split(".")
        if not sep or len(parts) != 3 or not parts[0].isdigit() or parts[1] not in _SHARDS:
            return None
        param, block = _SHARDS[parts[1]]
        return f"{prefix}.experts.{param}_{parts[2]}", (int(parts[0]), block)

    def _features(self, param_name: str) -> tuple[int, int]:
        """(output features of one checkpoint tensor, input features) of w13 (gate or up) or w2."""
        hidden, inter = self.w2_features
        return (inter, hidden) if param_name.startswith("w13") else (hidden, inter)

    @staticmethod
    def split_fused_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """The fused 3-D layout of Qwen3.5-MoE's released checkpoints (and HF's modules) as per-expert
        tensors: '...mlp.experts.gate_up_proj' [E, 2I, H] (per expert: gate rows, then up) ->
        '...mlp.experts.{e}.gate_proj.weight' and '.up_proj.weight' [I, H]; '...mlp.experts.down_proj'
        [E, H, I] -> '...mlp.experts.{e}.down_proj.weight' [H, I]. Views, no copies. None: not fused."""
        prefix, sep, leaf = name.rpartition(".experts.")
        if not sep or leaf not in ("gate_up_proj", "down_proj") or tensor.dim() != 3:
            return None
        experts = range(tensor.shape[0])
        if leaf == "down_proj":
            return [(f"{prefix}.experts.{e}.down_proj.weight", tensor[e]) for e in experts]
        gate, up = tensor.chunk(2, dim=1)
        return [(f"{prefix}.experts.{e}.{proj}.weight", half[e]) for e in experts
                for proj, half in (("gate_proj", gate), ("up_proj", up))]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int | None]) -> None:
        expert, block = shard_id
        local = expert - self.first_expert
        if not 0 <= local < self.num_local:
            return  # another rank's expert
        target = param.data[local]
        layout: TensorLayout | None = getattr(param, "tensor_layout", None)
        if layout is None:  # dense: gate / up [I, H] -> rows of [2I_local, H]; down [H, I] -> [H, I_local]
            inter = self.intermediate_size
            if block is not None:
                target = target.narrow(0, block * inter, inter)
            if loaded.shape[-1 if block is None else 0] != inter:  # this rank's slice of every expert
                loaded = loaded.narrow(1 if block is None else 0, self.split_rank * inter, inter)
            check_shape(target, loaded)
            target.copy_(loaded)
            return
        out, in_ = self._features(param.expert_param)
        check_shape(torch.empty(layout.shape(out, in_), device="meta"), loaded)
        scheme = self.schemes[param.expert_param]
        check_integer_dtype(target, loaded, layout, scheme.description)
        if not layout.kept:
            check_dropped(layout, loaded, scheme, out, in_, "expert")
            return
        out_axis = layout.axis(OUT)
        if block is not None and out_axis is not None:  # no output dim (g_idx): gate and up share it
            dim, per = out_axis
            target = target.narrow(dim, block * out // per, out // per)
        target.copy_(loaded)

    # ----- quantisation -------------------------------------------------------------------------
    def use_quant_scheme(self, scheme: LinearScheme | Mapping[str, LinearScheme | None], name: str,
                         device: torch.device | None = None) -> None:
        """Hold the experts' quantised tensors on ``device`` (default: the dense weights') instead of
        the dense w13 / w2 (before loading). ``scheme``: one for both stacks, or {"w13": ..., "w2": ...}
        (None: that stack stays dense)."""
        schemes = dict(scheme) if isinstance(scheme, Mapping) else {"w13": scheme, "w2": scheme}
        if self.split_rank or self.intermediate_size != self.full_intermediate:
            self._partition(whole=True, device=self.w13_weight.device)  # quantised experts are divided whole
        hidden, inter = self.w2_features
        device = device or self.w13_weight.device
        # (stack, one checkpoint tensor's out x in features, tensors stacked: gate and up make w13)
        for prefix, (out, in_), stacked in (("w13", (inter, hidden), 2), ("w2", (hidden, inter), 1)):
            stack_scheme = schemes.get(prefix)
            if stack_scheme is None:
                continue
            problem = stack_scheme.shape_problem(out, in_)
            if problem:
                raise ValueError(f"{name}: {stack_scheme.description} cannot hold an expert's {out} x {in_} "
                                 f"features: {problem}.")
            shard_ids = getattr(self, f"{prefix}_weight").shard_ids
            delattr(self, f"{prefix}_weight")
            for layout in stack_scheme.tensors:
                dtype = layout_dtype(layout, self.params_dtype)
                shape = layout.shape(stacked * out, in_)
                param = nn.Parameter(torch.empty(self.num_local, *shape, dtype=dtype, device=device),
                                     requires_grad=False)
                param.tensor_layout, param.expert_param, param.shard_ids = layout, prefix, shard_ids
                param.described_as = stack_scheme.description
                set_weight_loader(param, self.weight_loader)
                self.register_parameter(f"{prefix}_{layout.name}", param)
            self.schemes[prefix] = stack_scheme
            self.kernels[prefix] = reference_kernel(stack_scheme)

    def _expert_tensors(self, prefix: str, local: int) -> dict[str, torch.Tensor]:
        return {t.name: getattr(self, f"{prefix}_{t.name}").data[local] for t in self.schemes[prefix].tensors
                if t.kept}

    @property
    def supports_graph_capture(self) -> bool:
        """False where a step reads per-expert counts on the host (quantised experts looping, the
        dense loop), while expert load is counted (a recorded graph would not keep adding to the
        counter), and across data-parallel replicas (each layer's exchange is gloo traffic)."""
        return (not self.schemes or self.quant_grouped) and not self.moe_kernel.host_sync \
            and self.expert_load is None and not self.across_replicas

    def bind_kernels(self, kernels: KernelBundle) -> None:
        """Dense experts: the platform's MoE kernel, which may re-lay the weights out once.
        Quantised experts: the platform's quantised linear kernel prepares each expert once."""
        if kernels.moe is not None:
            self.moe_kernel = kernels.moe
        if not self.schemes:
            self.w13_weight.data, self.w2_weight.data = self.moe_kernel.prepare(self.w13_weight.data,
                                                                                self.w2_weight.data)
            return
        self.kernel_weight = {}
        for prefix, scheme in self.schemes.items():
            kernel = self.kernels[prefix] = kernels.quant_linear.get(scheme) or reference_kernel(scheme)
            prepared = [kernel.prepare(self._expert_tensors(prefix, local)) for local in range(self.num_local)]
            # new tensors (frees_original) are stacked, one copy; views of the parameters stay a list
            stacked = kernel.stack_experts(prepared) if kernel.frees_original else None
            self.kernel_weight[prefix] = prepared if stacked is None else stacked
            del prepared
            for layout in scheme.tensors:
                if kernel.frees_original or not layout.kept:
                    param = getattr(self, f"{prefix}_{layout.name}")
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self.quant_grouped = self._groups_quantised()

    def _groups_quantised(self) -> bool:
        """Every quantised stack's kernel runs its stacked experts as one call, and a dense stack
        beside them (GGUF) has torch._grouped_mm (the platform's dense MoE kernel is PyTorch's)."""
        for prefix in ("w13", "w2"):
            if prefix not in self.schemes:
                if type(self.moe_kernel) is not TorchGroupedMoe:
                    return False
            elif not isinstance(self.kernel_weight[prefix], dict) \
                    or not self.kernels[prefix].groups_experts(self.kernel_weight[prefix], self.params_dtype):
                return False
        return True

    def _stack(self, prefix: str, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """rows [R, in] sorted by local expert, ends [E_local] -> [R, out] through every local expert's
        w13 or w2 at once (grouped_experts' contract)."""
        if prefix not in self.schemes:
            return grouped_mm(rows, getattr(self, f"{prefix}_weight"), ends)
        return self.kernels[prefix].apply_experts(rows, ends, self.kernel_weight[prefix])

    def _expert(self, prefix: str, local: int, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] through local expert ``local``'s w13 or w2."""
        if prefix not in self.schemes:
            return F.linear(x, getattr(self, f"{prefix}_weight")[local])
        if self.kernel_weight is None:
            prepared = self._expert_tensors(prefix, local)
        else:
            held = self.kernel_weight[prefix]
            prepared = held[local] if isinstance(held, list) else expert_view(held, local)
        return self.kernels[prefix].apply(x, prepared, None)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> [T, H]."""
        weights, ids = self.moe_kernel.route(router_logits, self.top_k, self.renormalize)
        if self.expert_load is not None:
            self.expert_load += torch.bincount(ids.flatten(), minlength=self.num_experts)
        if self.across_replicas:
            return self._across_replicas(x, weights, ids)
        y = self._local_experts(x, weights, ids)
        if self.tp_size == 1:
            return y
        return expert_parallel_combine(y) if self.expert_parallel else tensor_model_parallel_all_reduce(y)

    def _local_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts' share of each token's output, [T, H] (zero rows for tokens routed elsewhere)."""
        if self.schemes:
            if self.quant_grouped:
                return grouped_experts(x, weights, ids, self.first_expert, self.num_local, self._stack)
            return loop_experts(x, weights, ids, self.first_expert, self.num_local, self._expert)
        return self.moe_kernel.experts(x, weights, ids, self.first_expert, self.w13_weight, self.w2_weight)

    def _across_replicas(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                         combine: bool = True) -> torch.Tensor:
        """Every replica's tokens through this rank's experts, summed over the replicas, own rows kept;
        then the TP all-reduce (``combine``; an empty step's rows are none, so it skips it)."""
        x_all, weights_all, ids_all, own = data_parallel.gather_tokens(x, weights, ids)
        if not x_all.shape[0]:  # no replica has a token this step (every one knows: the counts are shared)
            return x
        y = data_parallel.sum_over_replicas(self._local_experts(x_all, weights_all, ids_all))[own]
        return expert_parallel_combine(y) if combine and self.tp_size > 1 else y

    def exchange_without_tokens(self) -> None:
        """A replica's empty step: this layer's exchange with no tokens of its own, so the others' run."""
        device = self.w13_weight.device
        self._across_replicas(torch.empty(0, self.hidden_size, dtype=self.params_dtype, device=device),
                              torch.empty(0, self.top_k, dtype=self.params_dtype, device=device),
                              torch.empty(0, self.top_k, dtype=torch.int64, device=device), combine=False)


def run_moe_exchanges_without_tokens(model: nn.Module) -> None:
    """Every MoE layer's exchange, in the model's layer order, for a replica with nothing scheduled."""
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.exchange_without_tokens()
