"""CPU reference of the torch_npu ops the NPU attention backend calls, following their documented
semantics (Ascend op-plugin docs), with the documented argument contracts asserted.

Installed as ``sys.modules["torch_npu"]`` by tests; never used by the package."""

from __future__ import annotations

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


def module() -> types.ModuleType:
    fake = types.ModuleType("torch_npu")
    fake.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)  # no torch.npu: the platform stays CPU
    fake._npu_reshape_and_cache = _npu_reshape_and_cache
    fake.npu_fused_infer_attention_score = npu_fused_infer_attention_score
    return fake
