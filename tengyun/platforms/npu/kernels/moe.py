"""The experts of MoE layers through torch_npu's MoE ops, as vLLM-Ascend runs them.

NOT YET RUN ON HARDWARE: written against the documented torch_npu APIs (op-plugin
docs/zh/custom_APIs/torch_npu/torch_npu-<op>.md) and tested on CPU against a stand-in that
enforces their documented contracts (tests/platforms/fake_torch_npu.py).

- ``npu_moe_gating_top_k_softmax(logits float32 [T, E], None, k) -> (weights [T, k], expert ids
  int32 [T, k], row_idx)``: softmax over every expert, then the top k (fed float32, as PyTorch's
  route computes it); renormalised here where the model asks.
- ``npu_moe_init_routing(x [T, H], row_idx int32 [T, k], key int32 [T, k], active_num=T)
  -> (sorted rows [T * k, H], expanded_row_idx [T * k], sorted keys [T * k])``: rows sorted by
  key; row_idx[t, j] = j * T + t (the gating op's layout), and expanded_row_idx[j * T + t] is the
  sorted row of token t's j-th expert.
- ``npu_moe_compute_expert_tokens(sorted keys, n) -> [n] int32``: the end row of each key.
- ``npu_grouped_matmul([rows], [w [E_local, K, N]], group_list=ends int64, split_item=2,
  group_type=0, group_list_type=0)`` -> [rows @ w[e] per group]; rows past the last group are
  left unset by the document, so they are masked before the sum.
- ``npu_moe_finalize_routing(rows [T * k, H], None, None, None, scales [T, k], expanded_row_idx,
  None, drop_pad_mode=0) -> [T, H]``: sum over j of scales[t, j] * rows[expanded_row_idx[j * T + t]].
Experts of other ranks: the key maps them to one group after the local ones (layers/moe/routing.py)
with scale 0. grouped_matmul multiplies x @ w: the weights are stored [E, H, 2I] / [E, I, H] once
(``prepare``), seen by the layer as transposed views of its [E, 2I, H] / [E, H, I] parameters.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from tengyun.layers.moe.grouped import TorchGroupedMoe


class NpuMoe(TorchGroupedMoe):
    name = "npu_moe"
    host_sync = False

    def __init__(self):
        self.npu = importlib.import_module("torch_npu")

    def prepare(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[E, N, K] -> the same shape over [E, K, N] storage: w.transpose(1, 2) is contiguous."""
        return tuple(w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w13, w2))

    def route(self, router_logits: torch.Tensor, top_k: int, renormalize: bool):
        weights, ids, _ = self.npu.npu_moe_gating_top_k_softmax(router_logits.float(), None, k=top_k)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(router_logits.dtype), ids

    def _grouped_matmul(self, rows: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        return self.npu.npu_grouped_matmul([rows], [w.transpose(1, 2)], group_list=ends, split_item=2,
                                           group_type=0, group_list_type=0)[0]

    def experts(self, x, weights, ids, first, w13, w2):
        tokens, k = ids.shape
        num_local = w13.shape[0]
        key = ids.to(torch.int32) - first
        outside = (key < 0) | (key >= num_local)
        key = torch.where(outside, num_local, key)  # other ranks' experts: one group after the local ones
        row_idx = torch.arange(tokens * k, dtype=torch.int32, device=x.device).view(k, tokens).t().contiguous()
        rows, expanded_row_idx, sorted_key = self.npu.npu_moe_init_routing(x, row_idx, key, active_num=tokens)
        ends = self.npu.npu_moe_compute_expert_tokens(sorted_key, num_local + 1)[:num_local].to(torch.int64)
        gate, up = self._grouped_matmul(rows, w13, ends).chunk(2, dim=-1)
        out = self._grouped_matmul(F.silu(gate) * up, w2, ends)  # [T * k, H]
        local_rows = torch.arange(tokens * k, device=x.device) < ends[-1]
        out = torch.where(local_rows.unsqueeze(1), out, 0)
        scales = torch.where(outside, 0, weights).to(out.dtype)
        return self.npu.npu_moe_finalize_routing(out, None, None, None, scales, expanded_row_idx, None,
                                                 drop_pad_mode=0)
