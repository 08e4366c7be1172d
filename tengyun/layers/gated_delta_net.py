"""Gated DeltaNet (Qwen3.5's linear-attention layer) over the flat batch, state in a slot pool.

Per token: in_proj_qkv -> depthwise causal conv1d (kernel K, SiLU) over the q|k|v channels ->
gated delta rule (state [Hv, Dk, Dv]) -> gated RMSNorm with silu(in_proj_z) -> out_proj.
Each sequence's conv state (its last K - 1 conv inputs) and SSM state live in row
``state_slot`` of ``conv_state`` / ``ssm_state``, bound by the worker. Decodes (the first
``num_decode_tokens`` tokens, one per sequence) run as one batched recurrent step; each prefill
chunk runs the chunked form from its sequence's state, so a prompt may span several steps.
"""

from __future__ import annotations

import functools
import torch
import torch.nn.functional as F
from torch import nn

from tengyun.distributed.parallel_state import get_tp_rank, get_tp_size
from tengyun.layers.attention.metadata import AttentionMetadata, PrefillChunk, get_attention_metadata
from tengyun.layers.gated_delta_rule import GatedDeltaRuleKernel, TorchGatedDeltaRule
from tengyun.layers.kernels import KernelBundle
from tengyun.layers.layernorm import GatedRMSNorm
from tengyun.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from tengyun.layers.weight_loading import check_shape, rank_slice_of_segments, set_weight_loader
from tengyun.model_spec import ModelSpec


class GatedDeltaNet(nn.Module):
    """Tensor parallel by heads: each rank holds 1/tp of the key heads and of the value heads (a
    rank's value heads share only its own key heads), so the conv channels, the state and the
    in/out projections split with them; out_proj all-reduces."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        hidden, tp, linear = spec.hidden_size, get_tp_size(), spec.linear_attention
        total_k_heads, total_v_heads = linear.num_key_heads, linear.num_value_heads
        self.k_dim, self.v_dim = linear.key_head_dim, linear.value_head_dim
        self.num_k_heads, self.num_v_heads = total_k_heads // tp, total_v_heads // tp  # this rank's
        self.key_size, self.value_size = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.kernel_size = linear.conv_kernel
        # The checkpoint's q | k | v channels, full size; each rank keeps its slice of each.
        channels = [total_k_heads * self.k_dim] * 2 + [total_v_heads * self.v_dim]
        self.in_proj_qkv = MergedColumnParallelLinear(hidden, channels, False, dtype)
        self.in_proj_z = ColumnParallelLinear(hidden, total_v_heads * self.v_dim, False, dtype)
        self.in_proj_b = ColumnParallelLinear(hidden, total_v_heads, False, dtype)
        self.in_proj_a = ColumnParallelLinear(hidden, total_v_heads, False, dtype)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel_size, bias=False,
                                groups=self.conv_dim, dtype=dtype)  # weight [conv_dim, 1, K], this rank's channels
        self.conv1d.weight.requires_grad_(False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads, dtype=dtype), requires_grad=False)
        rank = get_tp_rank()
        for param, sizes in ((self.conv1d.weight, channels), (self.dt_bias, [total_v_heads]),
                             (self.A_log, [total_v_heads])):
            set_weight_loader(param, functools.partial(_load_rank_slice, sizes=sizes, tp_rank=rank, tp_size=tp))
        self.norm = GatedRMSNorm(self.v_dim, spec.rms_norm_eps, dtype)  # per head: replicated
        self.out_proj = RowParallelLinear(total_v_heads * self.v_dim, hidden, False, dtype)
        self.kernel: GatedDeltaRuleKernel = TorchGatedDeltaRule()  # the platform's once bound (bind_kernels)
        # Bound by the worker: [num_slots, conv_dim, K - 1] (model dtype), [num_slots, Hv, Dk, Dv] float32.
        self.conv_state = torch.empty(0)
        self.ssm_state = torch.empty(0)

    def bind_kernels(self, kernels: KernelBundle) -> None:
        assert kernels.gated_delta_rule is not None, "Platform.kernels(..., linear_attention=False) for Gated DeltaNet"
        self.kernel = kernels.gated_delta_rule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        meta = get_attention_metadata()
        mixed = self.in_proj_qkv(x)  # [T, conv_dim]
        beta = self.in_proj_b(x).sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [T, Hv]
        out = torch.empty(x.shape[0], self.num_v_heads, self.v_dim, dtype=x.dtype, device=x.device)
        n = meta.num_decode_tokens
        if n:
            out[:n] = self._decode(mixed[:n], g[:n], beta[:n], meta)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(mixed[rows], g[rows], beta[rows], chunk)
        z = self.in_proj_z(x).view(-1, self.num_v_heads, self.v_dim)
        return self.out_proj(self.norm(out, z).flatten(1))

    def _split(self, mixed: torch.Tensor):
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        return (q.unflatten(-1, (self.num_k_heads, self.k_dim)), k.unflatten(-1, (self.num_k_heads, self.k_dim)),
                v.unflatten(-1, (self.num_v_heads, self.v_dim)))

    def _decode(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """One token each of B sequences: mixed [B, conv_dim] -> [B, Hv, Dv]."""
        slots = meta.decode_state_slots
        # A one-token prompt has no state yet: start it from zeros.
        has_state = (meta.decode_seq_lens > 1).view(-1, 1, 1)
        window = torch.cat([self.conv_state[slots] * has_state, mixed.unsqueeze(-1)], dim=-1)  # [B, C, K]
        self.conv_state[slots] = window[..., 1:]
        mixed = F.silu((window * self.conv1d.weight.squeeze(1)).sum(-1))
        state = self.ssm_state[slots] * has_state.unsqueeze(-1)
        out, state = self.kernel.recurrent(*self._split(mixed), g, beta, state)
        self.ssm_state[slots] = state
        return out

    def _prefill(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        """L tokens of one sequence: mixed [L, conv_dim] -> [L, Hv, Dv]; continues its state when
        chunk.context_len > 0 (an earlier chunk of the same prompt ran before)."""
        slot, fresh = chunk.state_slot, chunk.context_len == 0
        prev = self.conv_state[slot]  # [C, K - 1]
        inputs = torch.cat([torch.zeros_like(prev) if fresh else prev, mixed.t()], dim=-1)  # [C, K - 1 + L]
        self.conv_state[slot] = inputs[:, -(self.kernel_size - 1):]
        mixed = F.silu(F.conv1d(inputs.unsqueeze(0), self.conv1d.weight, groups=self.conv_dim)[0]).t()  # [L, C]
        state = torch.zeros_like(self.ssm_state[slot]) if fresh else self.ssm_state[slot]
        out, state = self.kernel.chunk(*self._split(mixed), g, beta, state)
        self.ssm_state[slot] = state
        return out


def _load_rank_slice(param: nn.Parameter, loaded: torch.Tensor, sizes: list[int], tp_rank: int, tp_size: int) -> None:
    """conv1d.weight [conv_dim, 1, K] (q | k | v channels), dt_bias and A_log [Hv]: this rank's heads."""
    part = rank_slice_of_segments(loaded, sizes, tp_rank, tp_size)
    check_shape(param.data, part)
    param.data.copy_(part)
