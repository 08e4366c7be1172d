"""The compiled weight-only quantised linear (tengyun/csrc/quant_gemv.cpp): its layout, written
once at load, and its calls.

Layout (blocks of 32 output columns, K-major inside, so a few activation rows stream the weight
once, front to back, dequantised in registers):
  qpacked  4 bits: uint8 [ceil(out / 32), in, 16], inputs in pairs: byte i of (block b, inputs
           2p, 2p + 1) = n[32 b + i // 2, 2p + i % 2] | n[32 b + 16 + i // 2, 2p + i % 2] << 4 with n
           in [0, 16) (in and group even); 8 bits: int8 [ceil(out / 32), in, 32], byte j of (b, k) =
           q[32 b + j, k].
  qscales  [ceil(out / 32), in / group, 32] in the checkpoint's scale dtype; qzeros uint8 or
           qoffsets (scale dtype) likewise, or neither (a constant zero point, the scheme's);
  qcolumns uint8 [out, 0]: holds no bytes, only the output count (the blocks are padded).
Arithmetic (the kernel's contract, quant_gemv.cpp): w = fma(n, s, o) in float32 with o = offset,
or -zero * s; y = x w^T + bias with float32 sums (4 bits, and 8 bits from 5 rows: per group
s * sum(x n) + o * sum(x), products exact), rounded once to bfloat16. -zero * s is exact when s
is a 16-bit float (4 + 11 significant bits), so w is (n - zero) * s rounded once: the
references' dequantized values exactly; ``pack`` refuses (None) scales where it is not.

Rows up to MAX_KERNEL_ROWS (AMX_MAX_KERNEL_ROWS on cores with AMX) run the kernel; more rows
dequantize the whole weight once per call
(``quant_dequantize_t``, [in, out] bfloat16, freed after the call) and run one dense matmul,
measured faster there than the kernel's repeated passes or torch's int4 matmul
(benchmarks/quant_gemv_kernels.py, benchmarks/README.md). One resident copy either way.
A weight whose dequantized copy would not stay in cache (LARGE_WEIGHT_BYTES: an LM head, 151936 x
896 for Qwen2.5) pays that copy in DRAM writes: it runs the kernel on chunks of kernel_rows() rows
up to LARGE_WEIGHT_CHUNKED_ROWS rows instead (Qwen2.5's head at 64 rows, 8 bits: 93 vs 171 ms;
4 bits: 67 vs 158 ms; even at 256 rows).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tengyun.layers.quant_kernels import Tensors

COLS = 32  # output columns per block (quant_gemv.cpp kCols)
MAX_KERNEL_ROWS = 32  # more rows: dequantize once and multiply densely (crossover 32-64 rows, measured)
# On cores with AMX the dense bfloat16 matmul runs on its tiles and wins from ~20 rows: 2026-12-03's
# VM, 2 threads, SmolLM2's shapes, kernel / dequantize + dense ms: 4 bits (group 32) at 16 rows
# 0.886 / 1.199 (3072 x 576), at 32 rows 1.766 / 1.087; 8 bits at 16 rows 0.725 / 0.889, at 32 rows
# 1.335 / 0.912 (benchmarks/README.md, "The AMX VM against vLLM").
AMX_MAX_KERNEL_ROWS = 16
# A weight of at least this many bytes dequantized to bfloat16 runs the kernel on row chunks up to
# LARGE_WEIGHT_CHUNKED_ROWS rows (2026-12-03's AMD VM, 2 threads: Qwen2.5's 4864 x 896 MLP
# projections, 8.7 MB, cross over at 64-128 rows either way; the heads, 56 and 272 MB, at ~256).
LARGE_WEIGHT_BYTES = 32 << 20
LARGE_WEIGHT_CHUNKED_ROWS = 256
LAYOUT_KEYS = ("qpacked", "qscales", "qzeros", "qoffsets", "qcolumns")


def quant_gemv_fits() -> bool:
    """Whether the compiled kernels are loaded and this CPU runs quant_linear (AVX-512 BF16)."""
    from tengyun.platforms.cpu import native

    return native.load_error() is None and bool(torch.ops.tengyun.quant_linear_supported())


def layout_bytes(out: int, in_: int, groups: int, bits: int, scale_bytes: int, zeros: bool, offsets: bool) -> int:
    """Bytes ``pack`` holds: packed values and per-group parameters, outputs padded to 32."""
    padded = -(-out // COLS) * COLS
    per_group = scale_bytes + (1 if zeros else 0) + (scale_bytes if offsets else 0)
    return padded * in_ * bits // 8 + padded * groups * per_group


def pack(values: torch.Tensor, bits: int, scale: torch.Tensor, zero_points: torch.Tensor | None = None,
         offsets: torch.Tensor | None = None) -> Tensors | None:
    """values [out, in] (4 bits: n in [0, 16); 8 bits: q in [-128, 128)), scale [out, groups],
    zero_points [out, groups] in [0, 16) or offsets [out, groups] (scale's dtype) -> the layout.
    None where -zero * s would round (float32 scales with zero points): the caller keeps its path."""
    if zero_points is not None and not _zero_term_exact(zero_points, scale):
        return None
    out, in_ = values.shape
    prepared = {"qpacked": _pack_values(values, bits), "qscales": _block_params(scale),
                "qcolumns": torch.empty(out, 0, dtype=torch.uint8)}
    if zero_points is not None:
        prepared["qzeros"] = _block_params(zero_points.to(torch.uint8))
    if offsets is not None:
        prepared["qoffsets"] = _block_params(offsets.to(scale.dtype))
    return prepared


def linear(x2: torch.Tensor, prepared: Tensors, bits: int, zero: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 [M, in] -> [M, out] in x2's dtype: the kernel for up to kernel_rows() bfloat16 rows
    (a large weight: on chunks of them, up to LARGE_WEIGHT_CHUNKED_ROWS), else the weight
    dequantized once into x2's dtype and one dense matmul."""
    rows = x2.shape[0]
    if x2.dtype == torch.bfloat16 and kernel_rows() < rows <= LARGE_WEIGHT_CHUNKED_ROWS \
            and _dequantized_bytes(prepared) >= LARGE_WEIGHT_BYTES:
        return torch.cat([linear(chunk, prepared, bits, zero, bias) for chunk in x2.split(kernel_rows())])
    if x2.dtype == torch.bfloat16 and rows <= kernel_rows():
        fused = bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())
        packed, scales = prepared["qpacked"], prepared["qscales"]
        y = _quant_linear_op()(x2, packed, bits, packed.shape[1] // scales.shape[1], scales, prepared.get("qzeros"),
                               prepared.get("qoffsets"), float(zero), prepared["qcolumns"].shape[0],
                               bias if fused else None)
        return y if fused else y + bias
    w_t = dequantized_t(prepared, bits, zero, "bfloat16" if x2.dtype == torch.bfloat16 else "float32")
    y = torch.mm(x2, w_t.to(x2.dtype))
    return y if bias is None else y + bias


def groups(stacked: Tensors) -> bool:
    """Is ``stacked`` experts in this layout (stack_experts' form, no act-order perm), each small
    enough that ``linear`` never chunks it (under LARGE_WEIGHT_BYTES dequantized)?"""
    if "qpacked" not in stacked or not set(stacked) <= set(LAYOUT_KEYS):
        return False
    return 2 * stacked["qpacked"].shape[2] * stacked["qcolumns"].shape[1] < LARGE_WEIGHT_BYTES


def experts_linear(x: torch.Tensor, ends: torch.Tensor, stacked: Tensors, bits: int, zero: int) -> torch.Tensor:
    """x [R, in] sorted by expert, ends int64 [E] -> [R, out]: expert e's rows as ``linear``
    computes them (kernel up to kernel_rows() bfloat16 rows, else dequantized once and a dense
    matmul), the loop over the experts inside one compiled op (csrc/moe_grouped.cpp); rows past
    ends[-1] are 0."""
    packed, scales = stacked["qpacked"], stacked["qscales"]
    return _moe_quant_linear_op()(x.contiguous(), ends, packed, bits, packed.shape[2] // scales.shape[2], scales,
                                  stacked.get("qzeros"), stacked.get("qoffsets"), float(zero),
                                  stacked["qcolumns"].shape[1], kernel_rows())


@functools.cache
def _moe_quant_linear_op():
    return torch.ops.tengyun.moe_quant_linear.default


def dequantized_t(prepared: Tensors, bits: int, zero: int, dtype: str = "float32") -> torch.Tensor:
    """The layout's weight transposed, w^T [in, out] in ``dtype`` (the kernel's w, rounded once)."""
    return torch.ops.tengyun.quant_dequantize_t(prepared["qpacked"], bits, _group(prepared), prepared["qscales"],
                                                prepared.get("qzeros"), prepared.get("qoffsets"), float(zero),
                                                prepared["qcolumns"].shape[0], dtype)


def rows(prepared: Tensors, ids: torch.Tensor, bits: int, zero: int, dtype: torch.dtype) -> torch.Tensor:
    """ids [T] -> the layout's weight rows [T, in] in ``dtype``: w = n * s + o in float32 (the
    kernel's w: n * s is exact for 16-bit scales and Q4_K's 17-bit d * sc, so one rounding, as
    fma), rounded once. Row r is column r % 32 of block r // 32."""
    block, column = ids // COLS, ids % COLS
    packed, scales = prepared["qpacked"], prepared["qscales"]
    if bits == 8:  # int8 [blocks, in, 32]
        n = packed[block, :, column]  # [T, in]
    else:  # uint8 [blocks, in, 16] = [blocks, in / 2 pairs, 16 columns, 2 inputs]: low half columns 0-15
        pairs = packed.view(packed.shape[0], -1, COLS // 2, 2)[block, :, column % (COLS // 2)]  # [T, in / 2, 2]
        n = (pairs >> (4 * (column >= COLS // 2)).to(torch.uint8).view(-1, 1, 1)) & 0x0F
    n = n.reshape(ids.shape[0], scales.shape[1], -1).float()  # [T, groups, group]
    scale = scales[block, :, column].float().unsqueeze(-1)  # [T, groups, 1]
    if "qoffsets" in prepared:
        offset = prepared["qoffsets"][block, :, column].float().unsqueeze(-1)
    elif "qzeros" in prepared:
        offset = -prepared["qzeros"][block, :, column].float().unsqueeze(-1) * scale
    else:
        offset = -float(zero) * scale
    return (n * scale + offset).reshape(ids.shape[0], -1).to(dtype)


@functools.cache
def kernel_rows() -> int:
    """The most rows the kernel takes on this CPU (AMX_MAX_KERNEL_ROWS where it has AMX-BF16)."""
    from tengyun.host.probe import cpu_flags

    return AMX_MAX_KERNEL_ROWS if "amx_bf16" in cpu_flags() else MAX_KERNEL_ROWS


@functools.cache
def _quant_linear_op():
    """The op's overload, resolved once (a call through torch.ops.tengyun.quant_linear resolves it
    every time: microseconds on each of a decode step's ~100 linears)."""
    return torch.ops.tengyun.quant_linear.default


def _dequantized_bytes(prepared: Tensors) -> int:
    """Bytes of the layout's weight dequantized to bfloat16 ([in, out])."""
    return 2 * prepared["qpacked"].shape[1] * prepared["qcolumns"].shape[0]


def _group(prepared: Tensors) -> int:
    return prepared["qpacked"].shape[1] // prepared["qscales"].shape[1]


def _zero_term_exact(zero_points: torch.Tensor, scale: torch.Tensor) -> bool:
    """-zero * s in float32 equals the exact product (always so for 16-bit scales)."""
    if scale.dtype in (torch.bfloat16, torch.float16):
        return True
    z, s = zero_points.double(), scale.double()
    return bool(torch.equal((z.float() * scale.float()).double(), z * s))


def _pack_values(values: torch.Tensor, bits: int) -> torch.Tensor:
    out, in_ = values.shape
    blocks = -(-out // COLS)
    padded = F.pad(values.to(torch.int32), (0, 0, 0, blocks * COLS - out))  # padding columns: 0
    if bits == 4:  # [block, half, column c, pair p, k % 2]: columns 0-15 low nibbles, 16-31 high
        halves = padded.view(blocks, 2, COLS // 2, in_ // 2, 2)
        pairs = (halves[:, 0] | (halves[:, 1] << 4)).permute(0, 2, 1, 3)  # [block, pair, c, k % 2]
        return pairs.to(torch.uint8).reshape(blocks, in_, COLS // 2)
    return padded.view(blocks, COLS, in_).transpose(1, 2).to(torch.int8).contiguous()


def _block_params(param: torch.Tensor) -> torch.Tensor:
    """[out, groups] -> [ceil(out / 32), groups, 32], padding columns 0."""
    out, groups = param.shape
    blocks = -(-out // COLS)
    padded = F.pad(param, (0, 0, 0, blocks * COLS - out))
    return padded.view(blocks, COLS, groups).transpose(1, 2).contiguous()
