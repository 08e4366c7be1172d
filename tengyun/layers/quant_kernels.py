"""How quantised linear layers multiply: the plain-PyTorch reference of each kernel kind.

A kernel takes the layer's loaded tensors by their checkpoint names (scheme.py), prepares them
once (``prepare``, which may repack; ``frees_original`` then drops the loaded ones) and computes
y = x W^T + b from the prepared dict (``apply``). Platforms pick faster kernels with the same
arithmetic (Platform.quant_linear_kernel: tengyun/platforms/cpu/kernels/quant.py, npu/kernels/quant.py); these
references run wherever nothing faster exists (and on CUDA), and define what the others must
match.

    w8a8_int8: s_x = max|x_t| / 127 per token t, x_q = round(x / s_x) in int8,
               y = (x_q @ w_q^T) * s_x * s_w   (int32 sums; vLLM's dynamic per-token scheme)
    wna16_int: w = (q - zero) * scale per group of input features, y = x @ w^T; every packing
               (compressed-tensors, AWQ, GPTQ) is first read into one form (Unpacked)
    w8a8_static_int8 (msModelSlim W8A8): x_q = round(x / input_scale + input_offset) in int8 for
               the whole tensor, y = (x_q @ w_q^T + quant_bias) * deq_scale
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tengyun.distributed.parallel_state import get_tp_size
from tengyun.layers.linear_kernel import RowReader
from tengyun.quantization.awq_gptq_packing import unpack_awq, unpack_gptq
from tengyun.quantization.packing import dequantize, unpack_int32
from tengyun.quantization.scheme import LinearScheme

Tensors = dict[str, torch.Tensor]


class QuantLinearKernel:
    frees_original = False  # prepare returns new tensors: the layer drops its loaded ones
    # apply reads the quantised weight as held, without dequantizing all of it at decode's row
    # counts: what a quantised LM head needs to be faster than a dense one (embed_head.py); a
    # kernel that may fall back per layer says so for each prepared layer (``streams``)
    streams_quantised = False

    def __init__(self, scheme: LinearScheme):
        self.scheme = scheme

    def prepare(self, tensors: Tensors) -> Tensors:
        return tensors

    def apply(self, x: torch.Tensor, prepared: Tensors, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def streams(self, prepared: Tensors) -> bool:
        """Does apply read ``prepared``'s quantised weight as held (streams_quantised), or did
        prepare keep the layer on a dequantizing path?"""
        return self.streams_quantised

    def stack_experts(self, prepared: list[Tensors]) -> Tensors | None:
        """The MoE experts' prepared tensors as one dict of [E, ...] stacks (stack_experts), or None."""
        return stack_experts(prepared)

    def groups_experts(self, stacked: Tensors, dtype: torch.dtype) -> bool:
        """Can ``apply_experts`` run these experts (stack_experts' form) on ``dtype`` activations as
        one grouped call? False: the MoE layer loops over its experts, reading their counts on the
        host (fused_moe.py)."""
        return False

    def apply_experts(self, x: torch.Tensor, ends: torch.Tensor, stacked: Tensors) -> torch.Tensor:
        """x [R, in], rows sorted by expert; ends int64 [E]: expert e's rows are ends[e - 1] ..
        ends[e] - 1 -> [R, out], expert e's rows through ``expert_view(stacked, e)`` as ``apply``
        computes them; rows past ends[-1] hold anything. No host read of ``ends``."""
        raise NotImplementedError

    def row_reader(self, prepared: Tensors, dtype: torch.dtype) -> RowReader | None:
        """ids [T] -> rows [T, in] in ``dtype`` of the weight ``prepared`` holds, each its
        dequantized values rounded once (so a quantised embedding, or a tied one read from its
        LM head's kernel, looks tokens up); None where this kernel cannot."""
        return None


def stack_experts(prepared: list[Tensors]) -> Tensors | None:
    """Each expert's prepared tensors (the same keys and shapes) -> one dict of [E, ...] stacks;
    None where they differ (or hold something other than tensors): the layer keeps the list."""
    keys = prepared[0].keys()
    if any(p.keys() != keys for p in prepared) or any(not isinstance(v, torch.Tensor) for v in prepared[0].values()):
        return None
    if any(p[k].shape != prepared[0][k].shape or p[k].dtype != prepared[0][k].dtype for p in prepared for k in keys):
        return None
    return {k: torch.stack([p[k] for p in prepared]) for k in keys}


def expert_view(stacked: Tensors, expert: int) -> Tensors:
    """One expert's prepared tensors out of stack_experts' form (views, contiguous)."""
    return {k: v[expert] for k, v in stacked.items()}


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q int8 [M, K], s_x float32 [M, 1]) with x ~ x_q * s_x, symmetric."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-10).div_(127.0)
    return torch.clamp(torch.round(xf / scale), -128, 127).to(torch.int8), scale


class ReferenceW8A8Kernel(QuantLinearKernel):
    """weight int8 [out, in], weight_scale [out, 1]. The int32 sums run as float32 here: exact
    while |sum| < 2^24 (faster kernels sum in int32)."""

    def apply(self, x, prepared, bias):
        x2 = x.reshape(-1, x.shape[-1])
        x_q, s_x = quantize_per_token(x2)
        acc = x_q.float() @ prepared["weight"].float().t()  # [M, out]
        y = (acc * s_x * prepared["weight_scale"].float().t()).to(x.dtype)
        y = y.reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


class Unpacked(NamedTuple):
    """A weight-only layer in the form every wna16 kernel starts from, whatever the checkpoint's
    packing: w[o, i] = (q[o, i] - zero[o, g(i)]) * scale[o, g(i)], g(i) = g_idx[i], or without
    g_idx i // (in / groups)."""

    q: torch.Tensor  # int8 [out, in]: the stored unsigned value - 2^(bits-1)
    scale: torch.Tensor  # [out, groups] (groups 1: per channel), the layer's dtype
    zero: torch.Tensor | None  # int8 or int16 [out, groups], offset as q; None: symmetric (zero 0)
    g_idx: torch.Tensor | None  # int64 [in]: GPTQ act order's group of each input; None: in order


def unpacked_weight(tensors: Tensors, scheme: LinearScheme) -> Unpacked:
    """A layer's loaded tensors, packed as ``scheme.packing`` says -> Unpacked. compressed-tensors:
    weight_packed [out, in * bits / 32], weight_scale [out, groups], weight_zero_point
    [out * bits / 32, groups]; AWQ and GPTQ: tengyun/quantization/awq_gptq_packing.py."""
    if scheme.packing == "awq":
        return Unpacked(*unpack_awq(tensors))
    if scheme.packing in ("gptq", "gptq_v2"):
        return Unpacked(*unpack_gptq(tensors, scheme))
    bits = scheme.weight_bits
    q = unpack_int32(tensors["weight_packed"], bits, dim=1)
    zero = tensors.get("weight_zero_point")
    return Unpacked(q, tensors["weight_scale"], None if zero is None else unpack_int32(zero, bits, dim=0), None)


def dequantize_unpacked(w: Unpacked, dtype: torch.dtype) -> torch.Tensor:
    """-> [out, in] in ``dtype``, (q - zero) * scale computed in float32."""
    if w.g_idx is None:
        return dequantize(w.q, w.scale, w.zero, dtype)
    values = w.q.float()
    if w.zero is not None:
        values -= w.zero.float()[:, w.g_idx]
    return (values * w.scale.float()[:, w.g_idx]).to(dtype)


def in_group_order(w: Unpacked, group_size: int | None) -> tuple[Unpacked, torch.Tensor | None] | None:
    """GPTQ act order -> the same layer with its inputs sorted by group, so that groups are runs of
    ``group_size`` inputs as the packed kernels need, and ``perm`` int64: y = gather_inputs(x, perm)
    @ w_sorted^T. g_idx [1, 0, 1, 0] (group 2) -> perm [1, 3, 0, 2]. (w, None) when already in
    order. A row-parallel rank's slice uses each group for fewer than ``group_size`` of its inputs:
    every group is padded to ``group_size`` with inputs that read a zero activation (perm entry
    ``in``), so the rank holds all groups (as many packed inputs as the whole layer).
    g_idx [1, 0, 1] of 2 groups of 2 -> perm [1, 3, 0, 2], q's columns [q1, 0, q0, q2]. None:
    a group holds more than ``group_size`` inputs (not a GPTQ g_idx)."""
    if w.g_idx is None:
        return w, None
    in_, groups = w.q.shape[1], w.scale.shape[1]
    counts = torch.bincount(w.g_idx, minlength=groups)
    if group_size is None or counts.numel() != groups or bool((counts > group_size).any()):
        return None
    perm = torch.argsort(w.g_idx, stable=True)
    unsorted = Unpacked(w.q, w.scale, w.zero, None)
    if groups * group_size == in_:
        if torch.equal(perm, torch.arange(in_, device=perm.device)):
            return unsorted, None
        return unsorted._replace(q=w.q.index_select(1, perm).contiguous()), perm
    sorted_groups = w.g_idx[perm]
    first_of_group = torch.cumsum(counts, 0) - counts  # sorted position of each group's first input
    slots = sorted_groups * group_size + torch.arange(in_, device=perm.device) - first_of_group[sorted_groups]
    padded_perm = torch.full((groups * group_size,), in_, dtype=perm.dtype, device=perm.device)
    padded_perm[slots] = perm
    q = torch.zeros(w.q.shape[0], groups * group_size, dtype=w.q.dtype, device=w.q.device)
    q[:, slots] = w.q.index_select(1, perm)
    return unsorted._replace(q=q), padded_perm


def gather_inputs(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """x [M, in] -> [M, len(perm)]: x[:, perm], an entry ``in`` (in_group_order's padding) reading 0."""
    if perm.numel() != x.shape[1]:
        x = F.pad(x, (0, 1))
    return x.index_select(1, perm)


class ReferenceWNA16Kernel(QuantLinearKernel):
    """The checkpoint's tensors (any ``scheme.packing``), unpacked and dequantized in x's dtype at
    every call (GPTQ act order through g_idx directly, on any rank's slice)."""

    def apply(self, x, prepared, bias):
        return F.linear(x, dequantize_unpacked(unpacked_weight(prepared, self.scheme), x.dtype), bias)


class ReferenceW8A8StaticKernel(QuantLinearKernel):
    """msModelSlim static W8A8 (tengyun/quantization/modelslim.py): weight int8 [out, in],
    input_scale / input_offset [1] for the whole activation tensor, deq_scale [out] (float32, or
    int64 holding float32 bits), quant_bias int32 [out] (the float bias folded in; ``bias`` is
    not added again). x_q = clamp(round(x * (1 / input_scale) + input_offset)), y = (x_q @ w^T +
    quant_bias) * deq_scale; sums in float32 here, exact while |sum| < 2^24."""

    def prepare(self, tensors: Tensors) -> Tensors:
        refuse_tensor_parallel_static_w8a8()
        return {"weight": tensors["weight"], "quant_bias": tensors["quant_bias"],
                "deq_scale": deq_scale_float32(tensors["deq_scale"]),
                "input_scale_reciprocal": 1.0 / tensors["input_scale"].float(),
                "input_offset": tensors["input_offset"].float()}

    def apply(self, x, prepared, bias):
        x2 = x.reshape(-1, x.shape[-1])
        x_q = quantize_per_tensor(x2, prepared["input_scale_reciprocal"], prepared["input_offset"])
        acc = x_q.float() @ prepared["weight"].float().t() + prepared["quant_bias"].float()  # [M, out]
        return (acc * prepared["deq_scale"]).to(x.dtype).reshape(*x.shape[:-1], -1)


def quantize_per_tensor(x: torch.Tensor, scale_reciprocal: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> int8 round(x * scale_reciprocal + offset), both [1] float32 (asymmetric, static)."""
    return torch.clamp(torch.round(x.float() * scale_reciprocal + offset), -128, 127).to(torch.int8)


def deq_scale_float32(deq_scale: torch.Tensor) -> torch.Tensor:
    """msModelSlim's deq_scale [out] -> float32: int64 values hold a float32's bits in their low
    32 bits (0x3C000000 -> 2^-7), float32 as is."""
    if deq_scale.dtype == torch.int64:
        return deq_scale.to(torch.int32).view(torch.float32)
    return deq_scale.float()


def refuse_tensor_parallel_static_w8a8() -> None:
    """quant_bias holds the whole input's zero-point correction, so a row-parallel rank cannot
    add its part: static W8A8 runs unsplit."""
    if get_tp_size() > 1:
        raise ValueError("ModelSlim static W8A8 (quant_bias folds the whole input's zero-point correction) runs "
                         "at --tensor-parallel-size 1: drop --tensor-parallel-size, or serve a W8A8_DYNAMIC export.")


REFERENCE_KERNELS = {"w8a8_int8": ReferenceW8A8Kernel, "wna16_int": ReferenceWNA16Kernel,
                     "w8a8_static_int8": ReferenceW8A8StaticKernel}


def reference_kernel(scheme: LinearScheme) -> QuantLinearKernel:
    if scheme.kernel.startswith("gguf_"):  # GGUF kept quantised: gguf_kernels.py
        from tengyun.layers.gguf_kernels import GgufReferenceKernel

        return GgufReferenceKernel(scheme)
    return REFERENCE_KERNELS[scheme.kernel](scheme)
