"""The torch backend's paged decode attention (batched matmuls over gathered blocks) against
scaled_dot_product_attention over each sequence's own context, gathered token by token: random
shapes with odd head counts, GQA and MHA, contexts that end inside a block, block sizes 16 and
128, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tengyun.layers.attention.metadata import AttentionMetadata
from tengyun.layers.attention.torch_sdpa import TorchSDPABackend

SHAPES = [  # (query heads, KV heads, head dim)
    (9, 3, 64),  # SmolLM2: GQA groups of 3
    (7, 7, 32),  # MHA, odd
    (14, 2, 64),  # Qwen2.5-0.5B
    (5, 1, 24),  # MQA, odd head dim
]


def _reference(q, k_cache, v_cache, tables, lens, scale):
    """Per sequence: its tokens read slot by slot from the cache, float32 SDPA."""
    block_size = k_cache.shape[1]
    out = []
    for row, length in enumerate(lens.tolist()):
        slots = [(int(tables[row, t // block_size]), t % block_size) for t in range(length)]
        keys = torch.stack([k_cache[b, o] for b, o in slots], dim=1).float()  # [Hkv, L, D]
        values = torch.stack([v_cache[b, o] for b, o in slots], dim=1).float()
        out.append(F.scaled_dot_product_attention(q[row].float().unsqueeze(1), keys, values, scale=scale,
                                                  enable_gqa=True).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
def test_decode_matches_sdpa_per_sequence(heads, kv_heads, dim, block_size, dtype, tolerance):
    gen = torch.Generator().manual_seed(heads * 1000 + block_size)
    batch, num_blocks = 6, 40
    lens = torch.tensor([1, block_size - 1, block_size, block_size + 1, 2 * block_size + 5, 3])
    blocks_needed = -(-int(lens.max()) // block_size)
    # Each sequence its own blocks, in a shuffled order (tables are not contiguous ranges).
    perm = torch.randperm(num_blocks, generator=gen)[: batch * blocks_needed]
    tables = perm.view(batch, blocks_needed)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.zeros(batch, dtype=torch.int64), num_decode_tokens=batch,
                             decode_block_tables=tables, decode_seq_lens=lens)
    out = TorchSDPABackend()._decode(q, k_cache, v_cache, meta, dim ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), _reference(q, k_cache, v_cache, tables, lens, dim ** -0.5),
                               atol=tolerance, rtol=tolerance)


def test_static_decode_length_pads_every_row_and_masks_the_padding():
    """Graph replay fixes decode_max_len (every table padded to max blocks): same answer."""
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(2, 8, 8, 2, 16, generator=gen)  # 8 blocks of 8 tokens, 2 KV heads
    tables, lens = torch.tensor([[3, 1, 0, 0], [2, 5, 7, 6]]), torch.tensor([9, 30])
    q = torch.randn(2, 4, 16, generator=gen)

    def decode(static_len):
        meta = AttentionMetadata(slot_mapping=torch.zeros(2, dtype=torch.int64), num_decode_tokens=2,
                                 decode_block_tables=tables, decode_seq_lens=lens, decode_max_len=static_len)
        return TorchSDPABackend()._decode(q, k_cache, v_cache, meta, 0.25)

    torch.testing.assert_close(decode(None), decode(32))
    torch.testing.assert_close(decode(32), _reference(q, k_cache, v_cache, tables, lens, 0.25))
