"""The torch backend's prefill attention against an explicit causal softmax per chunk: fresh
prompts of one length side by side (one batched SDPA), fresh prompts of other lengths, and a
later chunk of a prompt attending to its cached context, in one step; GQA, MHA and MQA, float32
and bfloat16."""

from __future__ import annotations

import pytest
import torch

from tengyun.layers.attention.metadata import AttentionMetadata, PrefillChunk
from tengyun.layers.attention.torch_sdpa import TorchSDPABackend, _fresh_runs


def _attend(q, keys, values, first_position: int, scale: float) -> torch.Tensor:
    """q [Lq, Hq, D] at positions first_position.., keys/values [L, Hkv, D] -> [Lq, Hq, D], float32."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.float().repeat_interleave(groups, 1), values.float().repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    future = torch.arange(keys.shape[0])[None, :] > (first_position + torch.arange(q.shape[0]))[:, None]
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (7, 7, 32), (5, 1, 24)])
def test_prefill_chunks_match_a_causal_softmax_each(dtype, tolerance, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(heads * dim)
    block_size, num_blocks, context = 16, 12, 20
    lengths = [7, 7, 7, 5, 7, 9]  # fresh prompts: a run of three, then 5, 7 (alone), then a later chunk
    total = sum(lengths)
    q = torch.randn(total, heads, dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    table = torch.tensor([3, 8])  # the last chunk's sequence: context + 9 tokens in blocks 3, 8
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    chunks = [PrefillChunk(s, n, 0, torch.tensor([0])) for s, n in zip(starts[:-1], lengths[:-1])]
    chunks.append(PrefillChunk(starts[-1], lengths[-1], context, table))
    positions = torch.arange(context, context + 9)
    slots = table[positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(slot_mapping=torch.zeros(total, dtype=torch.int64), num_decode_tokens=0,
                             prefills=chunks)
    backend = TorchSDPABackend()
    backend.write_kv(k[starts[-1]:], v[starts[-1]:], k_cache, v_cache,
                     AttentionMetadata(slot_mapping=slots, num_decode_tokens=0))
    assert [len(run) for run in _fresh_runs(chunks)] == [3, 1, 1, 1]
    out = backend.forward(q, k, v, k_cache, v_cache, meta, dim ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    for chunk in chunks[:-1]:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        torch.testing.assert_close(out[rows].float(), _attend(q[rows], k[rows], v[rows], 0, dim ** -0.5),
                                   atol=tolerance, rtol=tolerance)
    cached = [(int(table[p // block_size]), p % block_size) for p in range(context + 9)]
    keys = torch.stack([k_cache[b, o] for b, o in cached])
    values = torch.stack([v_cache[b, o] for b, o in cached])
    torch.testing.assert_close(out[starts[-1]:].float(), _attend(q[starts[-1]:], keys, values, context, dim ** -0.5),
                               atol=tolerance, rtol=tolerance)
