"""CPU reference of the torch_npu ops the NPU attention backend and the NPU layer ops call,
following their documented semantics (Ascend op-plugin docs), with the documented argument
contracts asserted. ``module().calls`` counts the calls per op.

Installed as ``sys.modules["torch_npu"]`` by tests; never used by the package."""

from __future__ import annotations

import collections
import functools
import importlib.machinery
import types

import torch
import torch.nn.functional as F


def _npu_reshape_and_cache(*, key, value, key_cache, value_cache, slot_indices):
    # key/value [T, H, D]; caches [num_blocks, block_size, H, D]; slot_indices int32 [T]
    assert slot_indices.dtype == torch.int32 and slot_indices.shape == key.shape[:1]
    assert key_cache.shape[2:] == key.shape[1:] and key.dtype == key_cache.dtype
    heads, dim = key.shape[1:]
    key_cache.view(-1, heads, dim)[slot_indices.long()] = key
    value_cache.view(-1, heads, dim)[slot_indices.long()] = value


def npu_fused_infer_attention_score(query, key, value, *, block_table=None, actual_seq_lengths_kv=None,
                                    actual_seq_lengths=None, num_heads=1, num_key_value_heads=0, scale=1.0,
                                    input_layout="BSH", block_size=0, atten_mask=None, sparse_mode=0, **unused):
    assert input_layout == "BSH" and block_table.dtype == torch.int32
    assert key.dim() == 3 and key.shape[1] == block_size, "paged key: [num_blocks, block_size, H * D]"
    batch, seq, hidden = query.shape
    head_dim = hidden // num_heads
    kv_heads = num_key_value_heads or num_heads
    assert key.shape[2] == kv_heads * head_dim and num_heads % kv_heads == 0
    if seq > 1:
        assert sparse_mode == 3 and atten_mask.shape == (2048, 2048) and atten_mask.dtype == torch.bool
        assert len(actual_seq_lengths) == batch
    out = torch.empty_like(query)
    for b in range(batch):
        length = actual_seq_lengths_kv[b]
        blocks = block_table[b, : -(-length // block_size)].long()
        k = key[blocks].reshape(-1, kv_heads, head_dim)[:length].transpose(0, 1)  # [Hkv, L, D]
        v = value[blocks].reshape(-1, kv_heads, head_dim)[:length].transpose(0, 1)
        q = query[b].view(seq, num_heads, head_dim).transpose(0, 1)  # [Hq, S, D]
        # sparse_mode 3, right-down causal: query i sees keys j <= length - seq + i
        allowed = torch.arange(length)[None, :] <= (length - seq + torch.arange(seq))[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
        out[b] = o.transpose(0, 1).reshape(seq, hidden)
    return out, torch.zeros(1)


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _rms_norm(x, gamma, epsilon):
    # y = x / sqrt(mean(x^2) + eps) * gamma over gamma's dims, computed in float32, returned in
    # x's dtype; rstd float32 with x's leading dims and 1 for each normalised one.
    assert x.dtype in _FLOATS and gamma.dtype == x.dtype, "gamma must have x's dtype"
    assert x.shape[x.dim() - gamma.dim():] == gamma.shape
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dims, keepdim=True) + epsilon)
    return (x32 * rstd * gamma.float()).to(x.dtype), rstd


def npu_rms_norm(self, gamma, epsilon=1e-6):
    return _rms_norm(self, gamma, epsilon)


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    # -> (rms_norm(x1 + x2), rstd, x1 + x2); the sum in x1's dtype, inputs untouched
    assert x1.dtype == x2.dtype and x1.shape == x2.shape
    x = x1 + x2
    y, rstd = _rms_norm(x, gamma, epsilon)
    return y, rstd, x


def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
    # half mode: input [B, S, N, D] ("BSND" here), r1/r2 [1, S, 1, D] in input's dtype, values in [-1, 1]
    assert rotary_mode == "half" and input.dim() == 4 and r1.dim() == 4 and r1.shape == r2.shape
    b, s, n, d = input.shape
    assert d % 2 == 0 and d < 896 and b < 1000 and n < 1000
    assert r1.shape in ((1, s, 1, d), (b, s, 1, d), (b, s, n, d)), "BSND takes r1/r2 as 1S1D, BS1D or BSND"
    assert r1.dtype == r2.dtype == input.dtype
    assert r1.abs().max() <= 1 and r2.abs().max() <= 1, "r1, r2 must lie in [-1, 1]"
    x1, x2 = torch.chunk(input, 2, -1)
    return r1 * input + r2 * torch.cat((-x2, x1), dim=-1)


def npu_dynamic_quant(x, smooth_scales=None):
    # per-token symmetric int8: (round(x / s) int8, s float32 [tokens]) with s = max|x| / 127
    assert x.dtype in _FLOATS and smooth_scales is None
    scale = x.float().abs().amax(dim=-1).clamp(min=1e-10) / 127.0
    return torch.clamp(torch.round(x.float() / scale.unsqueeze(-1)), -128, 127).to(torch.int8), scale


def npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):
    # per-channel along ``axis`` (scales, zero_points [C]): round(x / s + z) (div_mode) or
    # round(x * s + z), saturated to int8 for dtype torch.qint8
    assert dtype == torch.qint8 and axis == -1 and scales.shape == zero_points.shape == input.shape[-1:]
    y = input.float() / scales.float() if div_mode else input.float() * scales.float()
    return torch.clamp(torch.round(y + zero_points.float()), -128, 127).to(torch.int8)


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
    # x1 int8 [M, K], x2 int8 [K, N], scale [N] (or [1]; float32, or int64 holding float32 bits for
    # float16 outputs), pertoken_scale float32 [M] or None: (x1 @ x2) in int32 (+ an int32 bias),
    # times scale per column and pertoken_scale per row (+ a float bias), in output_dtype
    assert x1.dtype == x2.dtype == torch.int8 and x1.shape[1] == x2.shape[0] and offset is None
    assert scale.dim() == 1 and scale.shape[0] in (1, x2.shape[1])
    if pertoken_scale is None:  # without per-token scales, float16 outputs take the int64 scale form
        assert (scale.dtype == torch.int64) == (output_dtype == torch.float16)
    scale = scale.to(torch.int32).view(torch.float32) if scale.dtype == torch.int64 else scale.float()
    acc = (x1.to(torch.int64) @ x2.to(torch.int64)).float()
    if bias is not None and bias.dtype == torch.int32:
        acc, bias = acc + bias.float(), None
    y = acc * scale
    if pertoken_scale is not None:
        assert pertoken_scale.dtype == torch.float32 and pertoken_scale.shape == x1.shape[:1]
        y = y * pertoken_scale.unsqueeze(-1)
    return (y if bias is None else y + bias.float()).to(output_dtype or torch.int8)


def npu_convert_weight_to_int4pack(weight, inner_k_tiles=0):
    # int32 [K, N] of int4 values (-8..7) -> int32 [K, N / 8]: 8 values per int32 along N, value j
    # of a word in bits 4j..4j+3 (two's complement nibbles)
    assert weight.dtype == torch.int32 and weight.shape[1] % 8 == 0
    assert int(weight.min()) >= -8 and int(weight.max()) <= 7
    nibbles = (weight.to(torch.int64) & 0xF).reshape(weight.shape[0], -1, 8)
    words = (nibbles << (torch.arange(8) * 4)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                 quant_offset=None, bias=None, antiquant_group_size=0):
    # x [M, K]; weight int8 [K, N] or int4 packed int32 [K, N / 8]; antiquant_scale [N] per channel
    # or [K / group, N] per group, antiquant_offset (optional) shaped as the scale:
    # y = x @ ((weight + offset) * scale) in x's dtype
    assert x.dtype in (torch.float16, torch.bfloat16) and antiquant_scale.dtype == x.dtype
    if weight.dtype == torch.int32:
        words = weight.to(torch.int64) & 0xFFFFFFFF
        nibbles = (words.unsqueeze(-1) >> (torch.arange(8) * 4)) & 0xF
        weight = torch.where(nibbles >= 8, nibbles - 16, nibbles).reshape(weight.shape[0], -1)
    k, n = weight.shape
    assert x.shape[-1] == k
    # antiquant_offset: the scale's shape and dtype
    assert antiquant_offset is None or (antiquant_offset.shape == antiquant_scale.shape
                                        and antiquant_offset.dtype == x.dtype)
    if antiquant_group_size:
        assert antiquant_scale.shape == (k // antiquant_group_size, n)
        scale = antiquant_scale.float().repeat_interleave(antiquant_group_size, dim=0)
    else:
        assert antiquant_scale.shape == (n,)
        scale = antiquant_scale.float()
    offset = 0
    if antiquant_offset is not None:
        assert antiquant_offset.shape == antiquant_scale.shape and antiquant_offset.dtype == x.dtype
        offset = antiquant_offset.float()
        offset = offset.repeat_interleave(antiquant_group_size, dim=0) if antiquant_group_size else offset
    w = weight.float() + offset
    y = x.float() @ (w * scale)
    return (y if bias is None else y + bias.float()).to(x.dtype)


def module() -> types.ModuleType:
    fake = types.ModuleType("torch_npu")
    fake.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)  # no torch.npu: the platform stays CPU
    fake.calls = collections.Counter()
    for op in (_npu_reshape_and_cache, npu_fused_infer_attention_score, npu_rms_norm, npu_add_rms_norm,
               npu_rotary_mul, npu_dynamic_quant, npu_quantize, npu_quant_matmul, npu_convert_weight_to_int4pack,
               npu_weight_quant_batchmatmul):
        setattr(fake, op.__name__, _counted(op, fake.calls))
    return fake


def _counted(op, calls):
    @functools.wraps(op)
    def wrapper(*args, **kwargs):
        calls[op.__name__] += 1
        return op(*args, **kwargs)

    return wrapper
