"""The CPU's kernel candidates per op kind, best first (kernel_choice.py explains the table).

Asking reads the CPU's flags, the scheme and whether the compiled library (native.py) loads;
building imports the kernel module. ``compiled_layout`` is CpuPlatform._compiled_quant_layout:
whether the compiled quant kernel (quant_layout.py) runs here, asked through the platform so a
test can turn it off.

    attention:    cpu_paged (library loads; bfloat16 prompts tiled with AVX512_BF16, no AMX) > torch_sdpa
    linear:       cpu_packed_small_batch (AVX-512 [+BF16]) > onednn_packed (fp32/bf16)
                  > cpu_bf16_weights (bf16 where oneDNN packs none: AVX2) > dense
    quant_linear: cpu_w8a8 > cpu_gguf > cpu_int8_layout > cpu_int4pack > reference
    layer_ops:    cpu_fused (library loads) > torch
    sampler:      cpu_compiled (library loads) > torch
    moe:          torch_grouped_mm (any float dtype on CPU) > torch_loop
    lora:         cpu_padded > cpu_segmented (torch._grouped_mm) > cpu_grouped > masked_dense
"""

from __future__ import annotations

import logging
from typing import Callable

from tengyun.dtypes import DTYPE_BYTES, torch_dtype
from tengyun.platforms.base import reference_quant_bytes, torch_grouped_moe, why_not_grouped_mm
from tengyun.platforms.kernel_choice import KernelCandidate, KernelQuery, always

logger = logging.getLogger(__name__)

W8A8_KERNELS = ("w8a8_int8", "w8a8_static_int8")
INT4PACK_GROUP_SIZES = (32, 64, 128, 256)  # what torch's _weight_int4pack_mm_for_cpu takes


def int8_layout_fits(scheme, dtype: str) -> bool:
    """8-bit weight-only served in bfloat16: the compiled kernel's 8-bit layout where it runs
    (CpuInt8WeightOnlyKernel). Torch-free."""
    return scheme.kernel == "wna16_int" and scheme.weight_bits == 8 and dtype == "bfloat16"


def int4pack_fits(scheme, dtype: str, out: int) -> bool:
    """Does torch's int4 CPU matmul run this layer: 4-bit weight-only in groups it takes, served in
    bfloat16, ``out`` (this rank's outputs) a multiple of 16? Torch-free: the planner asks too."""
    return (scheme.kernel == "wna16_int" and scheme.weight_bits == 4 and dtype == "bfloat16"
            and scheme.group_size in INT4PACK_GROUP_SIZES and out % 16 == 0)


def _library_error(query: KernelQuery) -> str | None:
    from tengyun.platforms.cpu import native

    return native.load_error()


# ----- attention, layer ops, sampler: the compiled library or PyTorch ---------------------------
def _paged_detail(query: KernelQuery) -> str:
    """The kernels cpu_paged runs here: the decode kernel's instruction set, and the tiled prefill
    kernel where it runs for this dtype (its head-dim limit aside)."""
    import torch

    from tengyun.platforms.cpu import native
    from tengyun.platforms.cpu.kernels.attention import tiled_prefill_runs

    detail = f"compiled decode kernel, {native.isa()}"
    if query.dtype == "bfloat16" and query.kv_cache_dtype in (None, "auto", "bfloat16") and \
            tiled_prefill_runs(torch.bfloat16, torch.bfloat16, 64):
        detail += "; prompt chunks over 16 tokens in the tiled bfloat16 kernel"
    return detail


def _fused_layer_ops(query: KernelQuery):
    from tengyun.platforms.cpu.kernels.layer_ops import CpuFusedLayerOps

    return CpuFusedLayerOps()


def _compiled_sample_rows(query: KernelQuery):
    """csrc/sampling.cpp: argmax or inverse CDF straight from bf16 logits (64 x 49152 rows
    14.1 ms -> 1.3 ms on a 2-core EPYC)."""
    import torch

    return torch.ops.tengyun.sample_rows.default


def _padded_lora(query: KernelQuery):
    from tengyun.layers.lora.kernels import PaddedLoRA

    return PaddedLoRA()


def _segmented_lora(query: KernelQuery):
    from tengyun.layers.lora.kernels import SegmentedLoRA

    return SegmentedLoRA()


def _grouped_lora(query: KernelQuery):
    from tengyun.layers.lora.kernels import GroupedLoRA

    return GroupedLoRA()


# ----- dense linear -------------------------------------------------------------------------
def _why_not_onednn(query: KernelQuery) -> str | None:
    from tengyun.layers.linear_kernel import onednn_available

    return None if onednn_available(torch_dtype(query.dtype)) else f"oneDNN's packed linear does not run {query.dtype}"


def _why_not_small_batch(query: KernelQuery) -> str | None:
    from tengyun.platforms.cpu.kernels.linear import small_batch_kernel_fits

    if reason := _why_not_onednn(query):
        return reason
    return None if small_batch_kernel_fits(torch_dtype(query.dtype)) else \
        f"no compiled small-batch {query.dtype} kernel here (library not loaded, or no AVX-512 for it)"


def _small_batch_linear(query: KernelQuery):
    from tengyun.platforms.cpu.kernels.linear import CpuPackedLinearKernel

    return CpuPackedLinearKernel(torch_dtype(query.dtype))


def _why_not_bf16_weights(query: KernelQuery) -> str | None:
    from tengyun.platforms.cpu.kernels.bf16_weights import bf16_weight_kernel_fits

    if query.dtype != "bfloat16":
        return f"bfloat16 weights only, not {query.dtype}"
    if reason := _library_error(query):
        return reason
    return None if bf16_weight_kernel_fits() else "this CPU lacks AVX2 + FMA"


def _bf16_weight_linear(query: KernelQuery):
    from tengyun.platforms.cpu.kernels.bf16_weights import CpuBf16WeightKernel

    return CpuBf16WeightKernel()


def _onednn_linear(query: KernelQuery):
    from tengyun.layers.linear_kernel import OneDNNPackedLinearKernel

    return OneDNNPackedLinearKernel()


# ----- quantised linear ----------------------------------------------------------------------
def _w8a8_candidate() -> KernelCandidate:
    def why_not(query):
        return None if query.scheme.kernel in W8A8_KERNELS else "not a W8A8 scheme"

    def build(query):
        from tengyun.platforms.cpu import native
        from tengyun.platforms.cpu.kernels import quant

        kernel = quant.CpuW8A8Kernel if query.scheme.kernel == "w8a8_int8" else quant.CpuW8A8StaticKernel
        return kernel(query.scheme, compiled=native.load_error() is None)

    def nbytes(query, out, in_, in_total):
        from tengyun.platforms.cpu.kernels.quant import packed_weight_bytes, w8a8_packed_fits

        if not w8a8_packed_fits():  # torch._int_mm on the checkpoint's int8 weight
            return reference_quant_bytes(query, out, in_, in_total)
        if query.scheme.kernel == "w8a8_int8":  # packed (outputs padded to 16, inputs to 4) + weight_scale
            return packed_weight_bytes(out, in_) + out * DTYPE_BYTES[query.dtype]
        # + quant_bias int32, deq_scale float32, the input scale's reciprocal and offset
        return packed_weight_bytes(out, in_) + 8 * out + 8

    return KernelCandidate("cpu_w8a8", why_not, build, nbytes)


def _gguf_candidate(compiled_layout: Callable[[], bool]) -> KernelCandidate:
    def why_not(query):
        return None if query.scheme.kernel.startswith("gguf_") else "not a GGUF block type"

    def build(query):
        from tengyun.platforms.cpu.kernels.gguf import gguf_kernel

        return gguf_kernel(query.scheme, torch_dtype(query.dtype), compiled=compiled_layout())

    def nbytes(query, out, in_, in_total):  # its int4 repack or compiled layout, or its blocks
        from tengyun.platforms.cpu.kernels.gguf import weight_bytes

        repacked = weight_bytes(query.scheme, out, in_, query.dtype, compiled=compiled_layout())
        return reference_quant_bytes(query, out, in_, in_total) if repacked is None else repacked

    return KernelCandidate("cpu_gguf", why_not, build, nbytes)


def _act_order_inputs(query: KernelQuery, in_: int, in_total: int | None) -> tuple[int, int]:
    """(inputs the packed layout holds, bytes of the act-order permutation): GPTQ act order pads a
    row-parallel slice to every group (the whole layer's inputs) and keeps an int64 perm [in]."""
    if not query.scheme.act_order:
        return in_, 0
    in_ = in_total or in_
    return in_, 8 * in_


def _int8_layout_candidate(compiled_layout: Callable[[], bool]) -> KernelCandidate:
    def why_not(query):
        if not int8_layout_fits(query.scheme, query.dtype):
            return "8-bit weight-only served in bfloat16 only"
        return None if compiled_layout() else "the compiled quant kernel does not run here"

    def build(query):
        from tengyun.platforms.cpu.kernels.quant import CpuInt8WeightOnlyKernel

        return CpuInt8WeightOnlyKernel(query.scheme)

    def nbytes(query, out, in_, in_total):  # int8 values; a scale in dtype, or float32 scale + offset
        from tengyun.platforms.cpu.kernels.quant_layout import layout_bytes

        scheme = query.scheme
        in_, permutation = _act_order_inputs(query, in_, in_total)
        groups = in_ // (scheme.group_size or in_)
        scale_bytes = DTYPE_BYTES[query.dtype] if scheme.symmetric else 4
        return layout_bytes(out, in_, groups, 8, scale_bytes, False, not scheme.symmetric) + permutation

    return KernelCandidate("cpu_int8_layout", why_not, build, nbytes)


def _int4pack_candidate(compiled_layout: Callable[[], bool]) -> KernelCandidate:
    """The compiled kernel's 4-bit layout where it runs, else torch's int4 layout; a layer whose
    outputs torch cannot pack (not a multiple of 16) stays on the reference (prepare decides)."""

    def why_not(query):
        if not int4pack_fits(query.scheme, query.dtype, 16):
            if query.scheme.weight_bits == 4 and query.dtype != "bfloat16":
                return "torch's int4 matmul takes bfloat16 activations only (--dtype bfloat16)"
            return "not 4-bit weight-only in groups of 32-256"
        import torch

        return None if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") else "this torch has no int4 CPU matmul"

    def build(query):
        from tengyun.platforms.cpu.kernels.quant import CpuInt4PackKernel

        return CpuInt4PackKernel(query.scheme, compiled=compiled_layout())

    def nbytes(query, out, in_, in_total):
        scheme = query.scheme
        in_, permutation = _act_order_inputs(query, in_, in_total)
        groups = in_ // scheme.group_size
        if compiled_layout():  # quant_layout.py: outputs padded to 32, uint8 zero points
            from tengyun.platforms.cpu.kernels.quant_layout import layout_bytes

            return layout_bytes(out, in_, groups, 4, DTYPE_BYTES[query.dtype], not scheme.symmetric, False) \
                + permutation
        if out % 16:
            return reference_quant_bytes(query, out, in_, in_total)
        # torch's layout: in x out / 2 bytes and a zero term beside every scale ([in / group, out, 2])
        return out * in_ // 2 + 2 * out * groups * DTYPE_BYTES[query.dtype] + permutation

    return KernelCandidate("cpu_int4pack", why_not, build, nbytes)


def cpu_candidates(kind: str, compiled_layout: Callable[[], bool]) -> list[KernelCandidate]:
    """The CPU's own candidates for ``kind``; the platform appends the plain-PyTorch ones."""
    if kind == "attention":
        return [KernelCandidate("cpu_paged", _library_error, lambda q: "cpu_paged", describe=_paged_detail)]
    if kind == "linear":
        return [KernelCandidate("cpu_packed_small_batch", _why_not_small_batch, _small_batch_linear),
                KernelCandidate("onednn_packed", _why_not_onednn, _onednn_linear),
                KernelCandidate("cpu_bf16_weights", _why_not_bf16_weights, _bf16_weight_linear,
                                describe=lambda q: "bfloat16 weights widened in registers, float32 FMA (AVX2)")]
    if kind == "quant_linear":
        return [_w8a8_candidate(), _gguf_candidate(compiled_layout), _int8_layout_candidate(compiled_layout),
                _int4pack_candidate(compiled_layout)]
    if kind == "layer_ops":
        return [KernelCandidate("cpu_fused", _library_error, _fused_layer_ops)]
    if kind == "sampler":
        return [KernelCandidate("cpu_compiled", _library_error, _compiled_sample_rows)]
    if kind == "moe":  # measured against the loop: benchmarks/moe_grouped.py
        return [KernelCandidate("torch_grouped_mm", why_not_grouped_mm, torch_grouped_moe,
                                describe=lambda q: "torch._grouped_mm, the same GEMMs as a loop, no host read")]
    if kind == "lora":  # by slot: measured faster than masked_dense here (layers/lora/kernels.py, docs/lora.md)
        return [KernelCandidate("cpu_padded", always, _padded_lora,
                                describe=lambda q: "decode tokens padded per slot once per step, two torch.bmm"),
                KernelCandidate("cpu_segmented", why_not_grouped_mm, _segmented_lora,
                                describe=lambda q: "tokens sorted by slot once per step, two torch._grouped_mm"),
                KernelCandidate("cpu_grouped", always, _grouped_lora)]
    return []

