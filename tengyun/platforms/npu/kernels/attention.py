"""Paged attention on Ascend NPUs through torch_npu's fused kernels.

NOT YET RUN ON HARDWARE: written against the documented torch_npu APIs and tested on CPU
against a stand-in that enforces their documented contracts (tests/platforms/fake_torch_npu.py).

- K/V into the paged cache (slot i of token t: ``cache[slot // block_size, slot % block_size] =
  k[t]``): ``torch_npu.npu_scatter_pa_kv_cache(..., cache_mode="Norm")`` (ND caches) where this
  torch_npu has it and the chip is an A2/A3 (the op's documented products), as vLLM-Ascend writes
  there; else the ATB op ``_npu_reshape_and_cache`` (vLLM-Ascend's 310P path), which torch_npu
  loads from the separate NNAL package on first call and which fails with OSError when NNAL is
  missing or its set_env.sh was not sourced.
- Attention: ``torch_npu.npu_fused_infer_attention_score`` over the cache with a block
  table, layout "BSH" (the cache viewed as [num_blocks, block_size, Hkv * D]), float16 / bfloat16
  only; its paged cache needs a block size of 128-512 in multiples of 128 for a multi-token query
  (16-aligned up to 512 for decode), which NpuPlatform.settings_problem asks of --block-size:
  decodes as one batch of Q_S = 1 (its IncreFlashAttention branch), each prefill chunk as
  one batch of Q_S = chunk length with sparse_mode 3 (causal aligned to the end of the
  context, so a later chunk sees the cached tokens before it).

Cache layout as every backend: k_cache, v_cache [num_blocks, block_size, Hkv, D].
"""

from __future__ import annotations

import torch

from tengyun.host.probe import NNAL_SET_ENV
from tengyun.layers.attention.backend import AttentionBackend
from tengyun.layers.attention.metadata import AttentionMetadata

# sparse_mode 2-4 take a compressed 2048 x 2048 mask (True = masked) instead of a full one.
_COMPRESSED_MASK_SIZE = 2048
_RIGHT_DOWN_CAUSAL = 3


class NpuAttentionBackend(AttentionBackend):
    name = "npu"

    def __init__(self):
        self._causal_mask: torch.Tensor | None = None
        self._scatter: bool | None = None  # npu_scatter_pa_kv_cache writes the cache (_scatter_writes)

    @staticmethod
    def _ops():
        import torch_npu

        return torch_npu

    def write_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        npu = self._ops()
        key, value = k.to(k_cache.dtype).contiguous(), v.to(v_cache.dtype).contiguous()
        slots = meta.slot_mapping.to(torch.int32).contiguous()
        if self._scatter is None:
            self._scatter = _scatter_writes(npu)
        if self._scatter:
            npu.npu_scatter_pa_kv_cache(key=key, value=value, key_cache=k_cache, value_cache=v_cache,
                                        slot_mapping=slots, cache_mode="Norm")
            return
        try:
            npu._npu_reshape_and_cache(key=key, value=value, key_cache=k_cache, value_cache=v_cache,
                                       slot_indices=slots)
        except OSError as e:  # the ATB library (NNAL) did not load
            raise RuntimeError(f"this torch_npu has no npu_scatter_pa_kv_cache, and its ATB cache write "
                               f"(_npu_reshape_and_cache) did not load: {e}. Install the NNAL package matching "
                               f"your CANN and run `source {NNAL_SET_ENV}`, or upgrade torch_npu "
                               f"(`tengyun doctor` checks both)") from e

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        n = meta.num_decode_tokens
        if n:
            out[:n] = self._attend(q[:n].unsqueeze(1), k_cache, v_cache, meta.decode_block_tables,
                                   meta.decode_seq_lens.tolist(), None, scale)[:, 0]
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            total = chunk.context_len + chunk.query_len
            out[rows] = self._attend(q[rows].unsqueeze(0), k_cache, v_cache, chunk.block_table.unsqueeze(0),
                                     [total], [chunk.query_len], scale)[0]
        return out

    def _attend(self, q, k_cache, v_cache, block_table, kv_lens: list[int], q_lens: list[int] | None,
                scale: float) -> torch.Tensor:
        """q [B, S, Hq, D] -> [B, S, Hq, D]; S > 1 (a prefill chunk) is causal to the context's end."""
        batch, seq, num_heads, head_dim = q.shape
        num_blocks, block_size, num_kv_heads, _ = k_cache.shape
        causal = {}
        if seq > 1:
            causal = dict(atten_mask=self._mask(q.device), sparse_mode=_RIGHT_DOWN_CAUSAL, actual_seq_lengths=q_lens)
        out, _ = self._ops().npu_fused_infer_attention_score(
            q.reshape(batch, seq, num_heads * head_dim).to(k_cache.dtype),
            k_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
            v_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
            block_table=block_table.to(torch.int32), actual_seq_lengths_kv=kv_lens,
            num_heads=num_heads, num_key_value_heads=num_kv_heads, scale=scale,
            input_layout="BSH", block_size=block_size, **causal,
        )
        return out.view(batch, seq, num_heads, head_dim).to(q.dtype)

    def _mask(self, device: torch.device) -> torch.Tensor:
        if self._causal_mask is None or self._causal_mask.device != device:
            size = _COMPRESSED_MASK_SIZE
            self._causal_mask = torch.triu(torch.ones(size, size, dtype=torch.bool, device=device), diagonal=1)
        return self._causal_mask


def _scatter_writes(npu) -> bool:
    """npu_scatter_pa_kv_cache is in this torch_npu and documented for this chip (Atlas A2 / A3, not
    the 310P inference cards)."""
    if not hasattr(npu, "npu_scatter_pa_kv_cache"):
        return False
    device = getattr(torch, "npu", None)  # absent on the CPU stand-in
    return device is None or "310" not in device.get_device_name()
