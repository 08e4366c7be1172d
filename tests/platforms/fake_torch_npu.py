"""A CPU stand-in for the torch_npu ops Tengyun calls, as strict as their documentation.

Each op takes exactly the arguments of its documented signature (op-plugin
op_plugin/config/op_plugin_functions.yaml; the ATB op as vLLM-Ascend calls it), refuses what the
op's document refuses (dtypes, shapes, block sizes, mask polarity, scale encodings), then computes
a reference of the documented semantics in float32. The section named above each op is the
document it follows (op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-<op>.md). A documented
feature Tengyun does not use is refused as NotImplementedError rather than emulated.

What it cannot check: the kernels' numerics (accumulation order and precision, fused softmax),
their speed and memory, NZ layouts, and anything the documents leave unsaid.

``module(nnal=False)``: the ATB op raises OSError as torch_npu does when the NNAL package is
missing or its set_env.sh was not sourced; ``module(scatter_pa_kv_cache=False)``: a torch_npu
without npu_scatter_pa_kv_cache. ``module().calls`` counts the calls per op. Installed as
``sys.modules["torch_npu"]`` by tests; never used by the package."""

from __future__ import annotations

import collections
import functools
import importlib.machinery
import types

import torch
import torch.nn.functional as F

_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
MAX_DIM = 65535
COMPRESSED_MASK = 2048


def _require(ok: bool, what: str) -> None:
    """torch_npu raises RuntimeError from its parameter checks."""
    if not ok:
        raise RuntimeError(what)


def _unused(**arguments) -> None:
    for name, value in arguments.items():
        if value is not None:
            raise NotImplementedError(f"the stand-in does not emulate {name}")


# ATB ReshapeAndCache (torch_npu._npu_reshape_and_cache, loaded from NNAL's libatb.so; vLLM-Ascend
# device_op.py calls it with these keywords): key/value [T, H, D] float16 / bfloat16 (int8 for a
# quantised cache), caches [num_blocks, block_size, H, D] of key's dtype, slot_indices int32 [T].
def _npu_reshape_and_cache(*, key, value, key_cache, value_cache, slot_indices):
    _require(key.dtype in _HALF + (torch.int8,), f"ReshapeAndCache takes float16 / bfloat16 / int8, not {key.dtype}")
    _require(key.dtype == value.dtype == key_cache.dtype == value_cache.dtype, "key, value and caches share a dtype")
    _require(slot_indices.dtype == torch.int32 and slot_indices.shape == key.shape[:1], "slot_indices int32 [T]")
    _require(key_cache.dim() == 4 and key_cache.shape[2:] == key.shape[1:], "caches [num_blocks, block_size, H, D]")
    _write_slots(key, value, key_cache, value_cache, slot_indices)


def _write_slots(key, value, key_cache, value_cache, slots):
    heads, dim = key.shape[1:]
    key_cache.view(-1, heads, dim)[slots.long()] = key
    value_cache.view(-1, heads, dim)[slots.long()] = value


# torch_npu-npu_scatter_pa_kv_cache.md, 场景一 with cache_mode "Norm" (ND caches, as vLLM-Ascend's
# A2/A3 path): key/value [T, H, D], caches [num_blocks, block_size, H, D] of key's dtype, slot_mapping
# int32 / int64 [T] in [0, num_blocks * block_size - 1] without repeats; inputs contiguous.
def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                            compress_seq_offsets=None, seq_lens=None, cache_mode="PA_NZ"):
    _unused(compress_lens=compress_lens, compress_seq_offsets=compress_seq_offsets, seq_lens=seq_lens)
    _require(cache_mode == "Norm", f"cache_mode {cache_mode!r} reads the caches as NZ; ND caches need 'Norm'")
    _require(all(t.is_contiguous() for t in (key, value, key_cache, value_cache, slot_mapping)),
             "npu_scatter_pa_kv_cache takes no non-contiguous input")
    _require(key.dtype in _FLOATS + (torch.int8,), f"npu_scatter_pa_kv_cache does not take {key.dtype}")
    _require(key.dtype == value.dtype == key_cache.dtype == value_cache.dtype, "key, value and caches share a dtype")
    _require(key.dim() == 3 and value.shape[:2] == key.shape[:2], "key/value [T, H, D]")
    _require(key_cache.dim() == 4 and key_cache.shape[2:] == key.shape[1:], "caches [num_blocks, block_size, H, D]")
    _require(slot_mapping.dtype in (torch.int32, torch.int64) and slot_mapping.shape == key.shape[:1],
             "slot_mapping int32 / int64 [T]")
    slots = key_cache.shape[0] * key_cache.shape[1]
    _require(bool(((slot_mapping >= 0) & (slot_mapping < slots)).all()), "slot_mapping outside the cache")
    _require(slot_mapping.unique().numel() == slot_mapping.numel(), "slot_mapping repeats a slot")
    _write_slots(key, value, key_cache, value_cache, slot_mapping)


def _check_paged(query, key, block_table, actual_seq_lengths_kv, block_size, seq):
    """torch_npu-npu_fused_infer_attention_score.md, PageAttention约束 (and the block_size parameter)."""
    _require(block_table.dtype == torch.int32 and block_table.dim() == 2, "block_table int32 [B, max blocks]")
    _require(actual_seq_lengths_kv is not None, "PageAttention needs actual_seq_lengths_kv")
    _require(key.dim() == 3 and key.shape[1] == block_size, "paged key [num_blocks, block_size, H * D] (BnBsH)")
    if seq > 1:
        _require(128 <= block_size <= 512 and block_size % 128 == 0,
                 f"block_size {block_size}: a query of Q_S > 1 needs 128-512 in multiples of 128")
    else:
        _require(0 < block_size <= 512 and block_size % 16 == 0,
                 f"block_size {block_size}: decode needs a multiple of 16 up to 512 (float16 / bfloat16)")
    _require(len(actual_seq_lengths_kv) == 1 or len(actual_seq_lengths_kv) >= query.shape[0],
             "actual_seq_lengths_kv: one length, or one per batch")
    for length in actual_seq_lengths_kv[:query.shape[0]]:
        _require(-(-length // block_size) <= block_table.shape[1], "block_table is shorter than the context")
        _require(seq > 1 or length <= 262144, "decode KV_S at most 262144")


def _check_mask(atten_mask, sparse_mode, seq, batch, actual_seq_lengths):
    """参数说明 atten_mask / sparse_mode, Q_S > 1专属约束: modes 2-4 take the compressed 2048 x 2048
    mask, lower triangle kept (True / 1 = masked: torch.triu(ones, diagonal=1))."""
    if seq == 1:
        _unused(atten_mask=atten_mask)  # Q_S = 1 without rope: sparse_mode has no effect
        return
    _require(sparse_mode in (0, 1, 2, 3, 4), f"sparse_mode {sparse_mode}: only 0-4 are supported")
    if sparse_mode == 0 and atten_mask is None:
        return
    _require(sparse_mode == 3, f"the stand-in emulates sparse_mode 0 without a mask and 3, not {sparse_mode}")
    _require(atten_mask is not None and atten_mask.dtype in (torch.bool, torch.int8, torch.uint8),
             "sparse_mode 3 needs atten_mask of bool / int8 / uint8")
    _require(atten_mask.shape[-2:] == (COMPRESSED_MASK, COMPRESSED_MASK) and atten_mask.numel() == COMPRESSED_MASK ** 2,
             "sparse_mode 2-4 take the compressed mask (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048)")
    upper = torch.triu(torch.ones(COMPRESSED_MASK, COMPRESSED_MASK, dtype=torch.bool), diagonal=1)
    _require(torch.equal(atten_mask.reshape(COMPRESSED_MASK, COMPRESSED_MASK).bool(), upper),
             "the compressed causal mask marks the masked (future) positions: torch.triu(ones, diagonal=1)")
    _require(actual_seq_lengths is not None and (len(actual_seq_lengths) == 1 or len(actual_seq_lengths) >= batch),
             "actual_seq_lengths: one length, or one per batch")
    _require(all(0 < n <= seq for n in actual_seq_lengths[:batch]), "actual_seq_lengths within Q_S")


# torch_npu-npu_fused_infer_attention_score.md: 参数说明, 各轴取值范围速查, PageAttention约束, Q_S > 1 /
# Q_S = 1 专属约束. Emulated: input_layout "BSH" over a paged cache, sparse_mode 0 (no mask) or 3.
def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None,
                                    dequant_scale2=None, quant_scale2=None, quant_offset2=None, antiquant_scale=None,
                                    antiquant_offset=None, key_antiquant_scale=None, key_antiquant_offset=None,
                                    value_antiquant_scale=None, value_antiquant_offset=None, block_table=None,
                                    query_padding_size=None, kv_padding_size=None, key_shared_prefix=None,
                                    value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None,
                                    key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0,
                                    pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH",
                                    num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                                    antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0,
                                    softmax_lse_flag=False):
    _unused(pse_shift=pse_shift, dequant_scale1=dequant_scale1, quant_scale1=quant_scale1,
            dequant_scale2=dequant_scale2, quant_scale2=quant_scale2, quant_offset2=quant_offset2,
            antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset, key_antiquant_scale=key_antiquant_scale,
            key_antiquant_offset=key_antiquant_offset, value_antiquant_scale=value_antiquant_scale,
            value_antiquant_offset=value_antiquant_offset, query_padding_size=query_padding_size,
            kv_padding_size=kv_padding_size, key_shared_prefix=key_shared_prefix,
            value_shared_prefix=value_shared_prefix, actual_shared_prefix_len=actual_shared_prefix_len,
            query_rope=query_rope, key_rope=key_rope, key_rope_antiquant_scale=key_rope_antiquant_scale)
    _require(not softmax_lse_flag and input_layout == "BSH", "the stand-in emulates input_layout BSH, no softmax_lse")
    _require(block_table is not None, "the stand-in emulates the paged cache (block_table) only")
    _require(query.dtype in _HALF, f"query takes float16 / bfloat16, not {query.dtype}")
    _require(key.dtype == value.dtype == query.dtype, "key/value float16 / bfloat16 as query")
    _require(all(t.is_contiguous() for t in (query, key, value)), "query, key, value must be contiguous")
    _require(key.shape == value.shape, "key and value shapes must match")
    batch, seq, hidden = query.shape
    kv_heads = num_key_value_heads or num_heads
    _require(num_heads <= 256 and kv_heads <= 256 and num_heads % kv_heads == 0 and num_heads // kv_heads <= 64,
             "num_heads, num_key_value_heads <= 256, num_heads a multiple of num_key_value_heads, ratio <= 64")
    _require(hidden % num_heads == 0, "query H = num_heads * D")
    head_dim = hidden // num_heads
    _require(head_dim <= 512 and head_dim * query.element_size() % 16 == 0, "D <= 512, 16-byte aligned")
    _require(batch <= 65536, "B <= 65536")
    _require(key.shape[2] == kv_heads * head_dim, "key H = num_key_value_heads * D")
    _check_paged(query, key, block_table, actual_seq_lengths_kv, block_size, seq)
    _check_mask(atten_mask, sparse_mode, seq, batch, actual_seq_lengths)
    out = torch.empty_like(query)
    for b in range(batch):
        length = actual_seq_lengths_kv[b if len(actual_seq_lengths_kv) > 1 else 0]
        blocks = block_table[b, : -(-length // block_size)].long()
        k = key[blocks].reshape(-1, kv_heads, head_dim)[:length].transpose(0, 1).float()  # [Hkv, L, D]
        v = value[blocks].reshape(-1, kv_heads, head_dim)[:length].transpose(0, 1).float()
        q = query[b].view(seq, num_heads, head_dim).transpose(0, 1).float()  # [Hq, S, D]
        mask = None
        if seq > 1 and sparse_mode == 3:  # right-down causal: query i sees keys j <= length - seq + i
            mask = torch.arange(length)[None, :] <= (length - seq + torch.arange(seq))[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[b] = o.transpose(0, 1).reshape(seq, hidden).to(query.dtype)
    return out, torch.zeros(1)


def _rms_norm(x, gamma, epsilon):
    # y = x / sqrt(mean(x^2) + eps) * gamma over gamma's dims, computed in float32, returned in
    # x's dtype; rstd float32 with x's leading dims and 1 for each normalised one.
    _require(x.dtype in _FLOATS and gamma.dtype == x.dtype, "gamma must have x's dtype")
    _require(x.shape[x.dim() - gamma.dim():] == gamma.shape, "gamma: x's trailing dims")
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dims, keepdim=True) + epsilon)
    return (x32 * rstd * gamma.float()).to(x.dtype), rstd


# torch_npu-npu_rms_norm.md
def npu_rms_norm(self, gamma, epsilon=1e-06):
    return _rms_norm(self, gamma, epsilon)


# torch_npu-npu_add_rms_norm.md: -> (rms_norm(x1 + x2), rstd, x1 + x2); the sum in x1's dtype
def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06):
    _require(x1.dtype == x2.dtype and x1.shape == x2.shape, "x1 and x2 share a dtype and shape")
    x = x1 + x2
    y, rstd = _rms_norm(x, gamma, epsilon)
    return y, rstd, x


# torch_npu-npu_rotary_mul.md, rotary_mode "half": input [B, S, N, D] read as BSND, r1/r2 [1, S, 1, D]
# (or BS1D, BSND) in input's dtype, values in [-1, 1]; D even and < 896, B and N < 1000.
def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):
    _unused(rotate=rotate)
    _require(rotary_mode == "half" and input.dim() == 4 and r1.dim() == 4 and r1.shape == r2.shape, "half, 4-D")
    b, s, n, d = input.shape
    _require(d % 2 == 0 and d < 896 and b < 1000 and n < 1000, "D even and < 896, B and N < 1000")
    _require(r1.shape in ((1, s, 1, d), (b, s, 1, d), (b, s, n, d)), "BSND takes r1/r2 as 1S1D, BS1D or BSND")
    _require(input.dtype in _FLOATS and r1.dtype == r2.dtype == input.dtype, "r1, r2 in input's dtype")
    _require(r1.abs().max() <= 1 and r2.abs().max() <= 1, "r1, r2 must lie in [-1, 1]")
    x1, x2 = torch.chunk(input, 2, -1)
    return r1 * input + r2 * torch.cat((-x2, x1), dim=-1)


# torch_npu-npu_dynamic_quant.md: x float16 / bfloat16 of 2+ dims -> (int8 round(x / s), s float32
# x.shape[:-1]) with s = max|x| / 127 per row.
def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken",
                      dst_type_max=0.0):
    _unused(smooth_scales=smooth_scales, group_index=group_index)
    _require(dst_type in (None, torch.int8) and quant_mode == "pertoken", "int8 per token")
    _require(input.dtype in _HALF, f"npu_dynamic_quant takes float16 / bfloat16, not {input.dtype}")
    _require(input.dim() > 1, "x must have more than one dim")
    scale = input.float().abs().amax(dim=-1).clamp(min=1e-10) / 127.0
    return torch.clamp(torch.round(input.float() / scale.unsqueeze(-1)), -128, 127).to(torch.int8), scale


# torch_npu-npu_quantize.md, div_mode False (as vLLM-Ascend's static W8A8): round(x * s + z) along
# the last axis, saturated to int8; scales and zero_points [K] of input's dtype.
def npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):
    _require(dtype == torch.qint8 and axis == -1 and not div_mode,
             "the stand-in emulates qint8, axis -1, div_mode False")
    _require(input.dtype in _FLOATS, f"npu_quantize takes float32 / float16 / bfloat16, not {input.dtype}")
    _require(scales.dtype == input.dtype, "div_mode False: scales in input's dtype")
    _require(zero_points is not None and zero_points.dtype == scales.dtype and zero_points.shape == scales.shape,
             "zero_points: the scales' shape and dtype")
    _require(scales.shape in (input.shape[-1:], (1,)), "scales [K] or [1]")
    y = input.float() * scales.float()
    return torch.clamp(torch.round(y + zero_points.float()), -128, 127).to(torch.int8)


# torch_npu-npu_trans_quant_param.md, 计算公式: out = (bits(scale) & 0xFFFFE000) | (1 << 46) (float32
# cut to its top 19 bits, bit 46 set), int64 of scale's shape.
def npu_trans_quant_param(scale, offset=None, round_mode=0):
    _unused(offset=offset)
    _require(round_mode == 0, "the stand-in emulates round_mode 0")
    _require(scale.dtype == torch.float32 and scale.is_contiguous(), "scale float32, contiguous")
    _require(scale.dim() == 1 or (scale.dim() == 2 and scale.shape[0] == 1), "scale (t,) or (1, n)")
    bits = scale.view(torch.int32).to(torch.int64) & 0xFFFFE000
    return bits | (1 << 46)


def _decode_trans_quant_param(scale):
    """int64 scale -> float32, refusing what npu_trans_quant_param cannot have built."""
    _require(bool((((scale >> 46) & 1) == 1).all()) and bool(((scale & 0x1FFF) == 0).all())
             and bool(((scale >> 47) == 0).all()) and bool((((scale >> 32) & 0x1F) == 0).all()),
             "an int64 scale must come from npu_trans_quant_param (top 19 bits of the float32, bit 46 set)")
    return (scale & 0xFFFFFFFF).to(torch.int32).view(torch.float32)


# torch_npu-npu_quant_matmul.md, 表 2 (A2/A3) rows with int8 x1/x2: K and N at most 65535; scale
# [1] or [N]; a float16 output without pertoken_scale takes an int64 scale from
# npu_trans_quant_param or float32; with pertoken_scale (float32 [M]) a float16 output takes only a
# float32 scale, a bfloat16 one float32 / bfloat16. -> ((x1 @ x2 (+ int32 bias)) * scale * pertoken
# (+ float bias)) in output_dtype.
def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                     x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None,
                     y_scale=None):
    _unused(offset=offset, x1_dtype=x1_dtype, x2_dtype=x2_dtype, pertoken_scale_dtype=pertoken_scale_dtype,
            scale_dtype=scale_dtype, group_sizes=group_sizes, y_scale=y_scale)
    _require(x1.dtype == x2.dtype == torch.int8 and x1.dim() == x2.dim() == 2,
             "the stand-in emulates int8 [M, K] @ [K, N]")
    _require(x1.shape[1] == x2.shape[0], "x1 [M, K], x2 [K, N]")
    _require(x1.shape[-1] <= MAX_DIM and x2.shape[-1] <= MAX_DIM, "x1's and x2's last dims at most 65535")
    _require(output_dtype in _HALF, f"the stand-in emulates float16 / bfloat16 outputs, not {output_dtype}")
    _require(scale.dim() == 1 and scale.shape[0] in (1, x2.shape[1]), "scale [1] or [N]")
    if pertoken_scale is not None:
        _require(pertoken_scale.dtype == torch.float32 and pertoken_scale.shape == x1.shape[:1],
                 "pertoken_scale float32 [M]")
        allowed = (torch.float32,) if output_dtype == torch.float16 else (torch.float32, torch.bfloat16)
    else:
        allowed = (torch.int64, torch.float32) if output_dtype == torch.float16 else (torch.float32, torch.bfloat16)
    with_or_without = "with" if pertoken_scale is not None else "without"
    _require(scale.dtype in allowed,
             f"scale {scale.dtype} with a {output_dtype} output {with_or_without} pertoken_scale: use {allowed}")
    if bias is not None:
        _require(bias.dtype in (torch.int32, torch.bfloat16, torch.float32) and bias.shape == x2.shape[1:],
                 "bias [N] int32 / bfloat16 / float32")
        _require(bias.dtype == torch.int32 or output_dtype == torch.bfloat16 or pertoken_scale is not None,
                 "a float bias needs a bfloat16 output or pertoken_scale")
    scale = _decode_trans_quant_param(scale) if scale.dtype == torch.int64 else scale.float()
    acc = (x1.to(torch.int64) @ x2.to(torch.int64)).float()
    if bias is not None and bias.dtype == torch.int32:
        acc, bias = acc + bias.float(), None
    y = acc * scale
    if pertoken_scale is not None:
        y = y * pertoken_scale.unsqueeze(-1)
    return (y if bias is None else y + bias.float()).to(output_dtype)


# torch_npu-npu_convert_weight_to_int4pack.md: int32 [K, N] of int4 values (-8..7), contiguous, N a
# multiple of 8 -> int32 [K, N / 8]: value j of a word in bits 4j..4j+3 (two's complement nibbles)
def npu_convert_weight_to_int4pack(weight, inner_k_tiles=0):
    _require(weight.dtype == torch.int32 and weight.dim() == 2 and weight.is_contiguous(),
             "weight int32 2-D, contiguous")
    _require(weight.shape[1] % 8 == 0, f"the last dim ({weight.shape[1]}) must be a multiple of 8")
    _require(int(weight.min()) >= -8 and int(weight.max()) <= 7, "values within int4's [-8, 7]")
    nibbles = (weight.to(torch.int64) & 0xF).reshape(weight.shape[0], -1, 8)
    words = (nibbles << (torch.arange(8) * 4)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


# torch_npu-npu_weight_quant_batchmatmul.md, 参数说明 and 约束说明: x float16 / bfloat16 [M, K]; weight
# int8 [K, N] or an int4 pack int32 [K, N / 8]; K and N in [1, 65535]; antiquant_scale of x's dtype,
# (1,) per tensor, (N,) / (1, N) per channel, (ceil(K / group), N) per group with group in [32, K - 1]
# and a multiple of 32; antiquant_offset the scale's shape and dtype. y = x @ ((w + offset) * scale).
def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                 quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0,
                                 weight_dtype=None):
    _unused(quant_scale=quant_scale, quant_offset=quant_offset, weight_dtype=weight_dtype)
    _require(x.dtype in _HALF and x.dim() == 2, f"x float16 / bfloat16 [M, K], not {x.dtype}")
    _require(antiquant_scale.dtype == x.dtype, "antiquant_scale of x's dtype")
    if weight.dtype == torch.int32:
        words = weight.to(torch.int64) & 0xFFFFFFFF
        nibbles = (words.unsqueeze(-1) >> (torch.arange(8) * 4)) & 0xF
        weight = torch.where(nibbles >= 8, nibbles - 16, nibbles).reshape(weight.shape[0], -1)
    else:
        _require(weight.dtype == torch.int8, "weight int8, or int32 holding int4")
    k, n = weight.shape
    _require(x.shape[1] == k, "x [M, K], weight [K, N]")
    _require(1 <= k <= MAX_DIM and 1 <= n <= MAX_DIM, f"K ({k}) and N ({n}) must lie in [1, 65535]")
    group = antiquant_group_size
    if group:
        _require(32 <= group <= k - 1 and group % 32 == 0,
                 f"antiquant_group_size {group} must lie in [32, K - 1 = {k - 1}] and be a multiple of 32")
        _require(antiquant_scale.shape == (-(-k // group), n), "per group: antiquant_scale (ceil(K / group), N)")
        scale = antiquant_scale.float().repeat_interleave(group, dim=0)[:k]
    else:
        _require(antiquant_scale.shape in ((1,), (1, 1), (n,), (1, n)), "antiquant_scale (1,), (N,) or (1, N)")
        scale = antiquant_scale.float().reshape(1, -1)
    offset = 0
    if antiquant_offset is not None:
        _require(antiquant_offset.shape == antiquant_scale.shape and antiquant_offset.dtype == antiquant_scale.dtype,
                 "antiquant_offset: the scale's shape and dtype")
        offset = antiquant_offset.float()
        offset = offset.repeat_interleave(group, dim=0)[:k] if group else offset.reshape(1, -1)
    if bias is not None:
        _require(bias.dtype == (torch.float32 if x.dtype == torch.bfloat16 else torch.float16), "bias dtype")
    y = x.float() @ ((weight.float() + offset) * scale)
    return (y if bias is None else y + bias.float()).to(x.dtype)


_OPS = (npu_fused_infer_attention_score, npu_rms_norm, npu_add_rms_norm, npu_rotary_mul, npu_dynamic_quant,
        npu_quantize, npu_trans_quant_param, npu_quant_matmul, npu_convert_weight_to_int4pack,
        npu_weight_quant_batchmatmul)


def _nnal_missing(**kwargs):
    raise OSError("libatb.so: cannot open shared object file: No such file or directory "
                  "(source /usr/local/Ascend/nnal/atb/set_env.sh)")


def module(nnal: bool = True, scatter_pa_kv_cache: bool = True) -> types.ModuleType:
    fake = types.ModuleType("torch_npu")
    fake.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)  # no torch.npu: the platform stays CPU
    fake.calls = collections.Counter()
    import fake_torch_npu_moe  # the MoE ops (imported here: it reads this module's checks)

    ops = _OPS + fake_torch_npu_moe.OPS + ((npu_scatter_pa_kv_cache,) if scatter_pa_kv_cache else ())
    for op in ops:
        setattr(fake, op.__name__, _counted(op, fake.calls))
    atb = _npu_reshape_and_cache if nnal else functools.wraps(_npu_reshape_and_cache)(_nnal_missing)
    fake._npu_reshape_and_cache = _counted(atb, fake.calls)
    return fake


def _counted(op, calls):
    @functools.wraps(op)
    def wrapper(*args, **kwargs):
        calls[op.__name__] += 1
        return op(*args, **kwargs)

    return wrapper
