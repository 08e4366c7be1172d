"""Paged attention in plain PyTorch (any device): gather blocks, then scaled_dot_product_attention.

Decodes (one query token each) run as one batched SDPA over their gathered, padded
contexts; each prefill chunk runs as its own causal SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tengyun.layers.attention.backend import AttentionBackend
from tengyun.layers.attention.metadata import AttentionMetadata, PrefillChunk


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"
    # Graph replay needs a static context: this backend would then gather max_model_len tokens
    # per decode row every step (memory and time grow with --max-model-len x batch).
    supports_decode_graphs = False

    def __init__(self):
        # Gather scratch reused by every layer and step (grow-only): a fresh multi-MB
        # buffer per call costs page faults that took longer than the copy itself.
        self._scratch: dict[str, torch.Tensor] = {}

    def _gather(self, name: str, cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
        """cache [N, bs, H, D], block_table [B, nb] (or [nb]) -> [B, H, length, D] (or [H, length, D])."""
        num_blocks, block_size, heads, dim = cache.shape
        flat_table = block_table.reshape(-1)
        need = flat_table.numel() * block_size * heads * dim
        scratch = self._scratch.get(name)
        if scratch is None or scratch.numel() < need or scratch.dtype != cache.dtype or scratch.device != cache.device:
            scratch = self._scratch[name] = torch.empty(need, dtype=cache.dtype, device=cache.device)
        rows = scratch[:need].view(flat_table.numel(), block_size * heads * dim)
        torch.index_select(cache.view(num_blocks, -1), 0, flat_table, out=rows)
        tokens = rows.view(*block_table.shape[:-1], -1, heads, dim)[..., :length, :, :]  # [..., L, H, D]
        return tokens.transpose(-3, -2)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        n = meta.num_decode_tokens
        if n:
            out[:n] = self._decode(q[:n], k_cache, v_cache, meta, scale)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, meta, scale)
        return out

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q [B, Hq, D] -> [B, Hq, 1, D]; contexts [B, Hkv, L, D] padded to the longest.
        max_len = meta.decode_max_len or meta.backend_state.get("decode_max_len")
        if max_len is None:
            max_len = meta.backend_state["decode_max_len"] = int(meta.decode_seq_lens.max())
        mask = meta.backend_state.get("decode_mask")
        if mask is None:
            positions = torch.arange(max_len, device=q.device)
            mask = (positions[None, :] < meta.decode_seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
            meta.backend_state["decode_mask"] = mask
        keys = self._gather("k", k_cache, meta.decode_block_tables, max_len).to(q.dtype)
        values = self._gather("v", v_cache, meta.decode_block_tables, max_len).to(q.dtype)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out.squeeze(2)

    def _prefill(self, q, k, v, k_cache, v_cache, chunk: PrefillChunk, meta, scale: float) -> torch.Tensor:
        # q [Lq, Hq, D]. A fresh prompt attends to its own k/v; a later chunk to the cache.
        if chunk.context_len == 0:
            keys, values, mask, causal = k.transpose(0, 1), v.transpose(0, 1), None, True
        else:
            total = chunk.context_len + chunk.query_len
            keys = self._gather("k", k_cache, chunk.block_table, total).to(q.dtype)
            values = self._gather("v", v_cache, chunk.block_table, total).to(q.dtype)
            key = ("prefill_mask", chunk.query_start)
            mask = meta.backend_state.get(key)
            if mask is None:
                q_pos = torch.arange(chunk.context_len, total, device=q.device)
                mask = q_pos[:, None] >= torch.arange(total, device=q.device)[None, :]  # [Lq, L]
                meta.backend_state[key] = mask
            causal = False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys, values, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
        return out.transpose(0, 1)
