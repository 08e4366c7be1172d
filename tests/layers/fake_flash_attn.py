"""CPU reference of the two flash-attn 2 calls the flash_attn attention backend makes, following
their docstrings in flash_attn/flash_attn_interface.py, with the documented argument contracts
asserted (the C++ side, csrc/flash_attn/flash_api.cpp, checks the same ones). ``module().calls``
counts the calls per function.

Installed as ``sys.modules["flash_attn"]`` by tests; never used by the package.
Shared semantics: GQA by head groups (query head h reads KV head h // (Hq // Hkv)); causal masks
aligned to the bottom-right corner (query i of Sq sees key j when j <= i + Sk - Sq); a row with
no key to see gives zeros; softmax_scale defaults to 1 / sqrt(headdim); out has q's dtype.
"""

from __future__ import annotations

import collections
import functools
import importlib.machinery
import types

import torch

_DTYPES = (torch.float16, torch.bfloat16)  # "FlashAttention only support fp16 and bf16 data type"


def _attend(q, k, v, scale, causal):
    """q [Sq, Hq, D], k/v [Sk, Hkv, D] -> [Sq, Hq, D], computed in float32."""
    seq_q, num_heads, head_dim = q.shape
    seq_k, num_kv_heads = k.shape[:2]
    assert num_heads % num_kv_heads == 0, "Number of heads in key/value must divide number of heads in query"
    group = num_heads // num_kv_heads
    k, v = (x.float().repeat_interleave(group, dim=1) for x in (k, v))  # [Sk, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if causal:
        visible = torch.arange(seq_k)[None, :] <= torch.arange(seq_q)[:, None] + seq_k - seq_q
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all-masked row -> zeros
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    # q (batch, seqlen, nheads, headdim); with a block_table, k_cache/v_cache are
    # (num_blocks, page_block_size, nheads_k, headdim), "page_block_size must be a multiple of 256";
    # block_table (batch, max_num_blocks_per_seq) int32; cache_seqlens int or (batch,) int32.
    assert k is None and v is None and rotary_cos is None and cache_batch_idx is None and cache_leftpad is None
    assert window_size == (-1, -1) and softcap == 0.0 and alibi_slopes is None, "not used by the backend"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "k_cache must have contiguous last dimension"
    assert q.dtype in _DTYPES and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
    batch, seq_q, num_heads, head_dim = q.shape
    assert head_dim <= 256 and k_cache.shape[-1] == head_dim
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32)
    assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (batch,)
    if block_table is not None:
        page = k_cache.shape[1]
        assert page % 256 == 0, "Paged KV cache block size must be divisible by 256"
        assert block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == batch
        assert block_table.stride(-1) == 1, "block_table must have contiguous last dimension"
        seqlen_cache = block_table.shape[1] * page
    else:
        seqlen_cache = k_cache.shape[1]
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.empty_like(q)
    for b in range(batch):
        length = int(cache_seqlens[b])
        assert length <= seqlen_cache
        if block_table is not None:
            blocks = block_table[b].long()
            keys, values = (c[blocks].flatten(0, 1)[:length] for c in (k_cache, v_cache))
        else:
            keys, values = k_cache[b, :length], v_cache[b, :length]
        out[b] = _attend(q[b], keys, values, scale, causal)
    return out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    # q (total_q, nheads, headdim), k/v (total_k, nheads_k, headdim); cu_seqlens_* (batch + 1,) int32;
    # max_seqlen_* int.
    assert dropout_p == 0.0 and window_size == (-1, -1) and softcap == 0.0 and alibi_slopes is None
    assert block_table is None and not return_attn_probs, "not used by the backend"
    assert q.dtype in _DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
    assert all(x.stride(-1) == 1 for x in (q, k, v)), "Input tensor must have contiguous last dimension"
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    assert cu_seqlens_q.shape == cu_seqlens_k.shape and cu_seqlens_q.is_contiguous()
    assert int(cu_seqlens_q[-1]) == q.shape[0] and int(cu_seqlens_k[-1]) == k.shape[0]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.empty_like(q)
    for b in range(cu_seqlens_q.numel() - 1):
        qs, qe, ks, ke = (int(x) for x in (cu_seqlens_q[b], cu_seqlens_q[b + 1], cu_seqlens_k[b], cu_seqlens_k[b + 1]))
        assert qe - qs <= max_seqlen_q and ke - ks <= max_seqlen_k
        out[qs:qe] = _attend(q[qs:qe], k[ks:ke], v[ks:ke], scale, causal)
    return out


def module() -> types.ModuleType:
    fake = types.ModuleType("flash_attn")
    fake.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    fake.__version__ = "2.8.3"
    fake.calls = collections.Counter()
    for fn in (flash_attn_with_kvcache, flash_attn_varlen_func):
        setattr(fake, fn.__name__, _counted(fn, fake.calls))
    return fake


def _counted(fn, calls):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        calls[fn.__name__] += 1
        return fn(*args, **kwargs)

    return wrapper
