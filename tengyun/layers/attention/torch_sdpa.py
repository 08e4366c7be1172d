"""Paged attention in plain PyTorch (any device): gather blocks, then attend.

Decodes (one query token each) run batched over their gathered, padded contexts (SDPA in
float32, two matmuls in 16-bit); each prefill chunk runs as its own causal SDPA, except that
fresh prompts of one length side by side in the batch (all requests at once) share one.
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
        self._prefill_chunks(out, q, k, v, k_cache, v_cache, meta.prefills, meta, scale)
        return out

    def _prefill_chunks(self, out, q, k, v, k_cache, v_cache, prefills: list[PrefillChunk], meta, scale: float):
        """out[rows] <- attention of each chunk's query rows; runs of fresh prompts share one SDPA."""
        for chunks in _fresh_runs(prefills):
            first = chunks[0]
            rows = slice(first.query_start, first.query_start + len(chunks) * first.query_len)
            if len(chunks) > 1:
                out[rows] = _fresh_prompts_sdpa(q[rows], k[rows], v[rows], len(chunks), scale)
            else:
                out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, first, meta, scale)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [B, Hq, D] -> [B, Hq, D]: one query token per sequence over its gathered context,
        padded to the longest. float32: torch's SDPA, which reads the gathered [B, L, H, D] blocks
        through strides. 16-bit caches: two batched matmuls instead, the query heads grouped by the
        KV head they read (GQA: head h reads KV head h // (Hq / Hkv)); for one query token torch's
        CPU SDPA runs ~6x slower than that in bfloat16, and the matmuls ~1.6x slower than SDPA in
        float32 (benchmarks/decode_attention_bandwidth.py, figures in benchmarks/README.md)."""
        max_len = meta.decode_max_len or meta.backend_state.get("decode_max_len")
        if max_len is None:
            max_len = meta.backend_state["decode_max_len"] = int(meta.decode_seq_lens.max())
        keys = self._gather("k", k_cache, meta.decode_block_tables, max_len)  # [B, Hkv, L, D]
        values = self._gather("v", v_cache, meta.decode_block_tables, max_len)
        bias = self._decode_bias(meta, max_len, q.device)
        if keys.dtype == torch.float32:
            out = F.scaled_dot_product_attention(q.float().unsqueeze(2), keys, values, attn_mask=bias, scale=scale,
                                                 enable_gqa=True)
            return out.squeeze(2).to(q.dtype)
        batch, num_heads, head_dim = q.shape
        grouped = q.to(keys.dtype).view(batch, keys.shape[1], num_heads // keys.shape[1], head_dim)  # [B, Hkv, G, D]
        # Scores scaled, masked and soft-maxed in float32; q.K^T is rounded to the cache dtype first,
        # as HF's eager attention does.
        scores = torch.matmul(grouped, keys.contiguous().transpose(-1, -2)).float().mul_(scale).add_(bias)
        probs = torch.softmax(scores, dim=-1).to(values.dtype)  # [B, Hkv, G, L]
        return torch.matmul(probs, values.contiguous()).view(batch, num_heads, head_dim).to(q.dtype)

    @staticmethod
    def _decode_bias(meta: AttentionMetadata, max_len: int, device) -> torch.Tensor:
        """[B, 1, 1, L] float32, shared by every layer of the step: 0 inside each sequence's
        context, -inf past it."""
        bias = meta.backend_state.get("decode_bias")
        if bias is None:
            past = torch.arange(max_len, device=device)[None, :] >= meta.decode_seq_lens[:, None]
            bias = torch.zeros(past.shape, dtype=torch.float32, device=device).masked_fill_(past, float("-inf"))
            bias = meta.backend_state["decode_bias"] = bias[:, None, None, :]
        return bias

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
        return _causal_sdpa(q.transpose(0, 1), keys, values, mask, causal, scale).transpose(0, 1)


def _fresh_runs(prefills: list[PrefillChunk]) -> list[list[PrefillChunk]]:
    """The chunks in order, grouped: runs of fresh prompts (no context) of one length whose rows
    follow each other, every other chunk alone."""
    runs: list[list[PrefillChunk]] = []
    for chunk in prefills:
        last = runs[-1][-1] if runs else None
        if (last is not None and chunk.context_len == 0 and last.context_len == 0
                and chunk.query_len == last.query_len and chunk.query_start == last.query_start + last.query_len):
            runs[-1].append(chunk)
        else:
            runs.append([chunk])
    return runs


def _fresh_prompts_sdpa(q, k, v, count: int, scale: float) -> torch.Tensor:
    """count fresh prompts of L tokens each, side by side: q [count * L, Hq, D], k/v [count * L,
    Hkv, D] -> [count * L, Hq, D], one causal SDPA over the batch of them (as many calls fewer)."""
    length = q.shape[0] // count

    def batched(x: torch.Tensor) -> torch.Tensor:  # [count * L, H, D] -> [count, H, L, D] (a view)
        return x.view(count, length, *x.shape[1:]).transpose(1, 2)

    out = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), is_causal=True, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).reshape(q.shape)


def _causal_sdpa(q, keys, values, mask, causal: bool, scale: float) -> torch.Tensor:
    """q [Hq, Lq, D], keys/values [Hkv, L, D] -> [Hq, Lq, D]. 4-D (a batch of one) and GQA through
    enable_gqa: PyTorch's CPU flash kernel takes that as it is, with no copy of the KV heads repeated
    per query head (3-D inputs fall to the math path, which materialises the [Lq, L] scores and
    masks them op by op: 2.6x slower at 256 + 256 tokens, 1 thread)."""
    out = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask,
                                         is_causal=causal, scale=scale, enable_gqa=q.shape[0] != keys.shape[0])
    return out[0]
