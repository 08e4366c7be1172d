"""The gated delta rule (Gated DeltaNet's recurrence) in plain PyTorch, behind a small kernel
interface that a platform's kernel replaces (flash-linear-attention on CUDA:
tengyun/layers/gated_delta_rule_fla.py).

Per value head h, with state S [Dk, Dv] and per-token q, k [Dk] (l2-normalised), v [Dv],
decay g <= 0 (log space) and beta in (0, 1):
    S <- exp(g) * S;  S <- S + k (beta * (v - S^T k))^T;  o = S^T (q / sqrt(Dk))
Key heads are shared by num_v_heads // num_k_heads consecutive value heads.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class GatedDeltaRuleKernel(Protocol):
    def chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence: q, k [L, Hk, Dk], v [L, Hv, Dv], g, beta [L, Hv], state [Hv, Dk, Dv] float32
        -> (out [L, Hv, Dv] in v's dtype, final state [Hv, Dk, Dv] float32)."""

    def recurrent(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token each of B sequences: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv],
        state [B, Hv, Dk, Dv] float32 -> (out [B, Hv, Dv], new state [B, Hv, Dk, Dv])."""


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, num_v_heads):
    """Repeat key heads over their value heads, float32, l2-normalise q/k and scale q by 1/sqrt(Dk)."""
    repeat = num_v_heads // q.shape[-2]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k, v.float()


class TorchGatedDeltaRule:
    def __init__(self, chunk_size: int = 64):
        self.chunk_size = chunk_size

    def recurrent(self, q, k, v, g, beta, state):
        out_dtype = v.dtype
        q, k, v = _prepare(q, k, v, v.shape[-2])  # [B, Hv, D]
        state = state * g.float().exp()[..., None, None]  # [B, Hv, Dk, Dv]
        delta = (v - torch.einsum("bhkv,bhk->bhv", state, k)) * beta.float()[..., None]
        state = state + k[..., :, None] * delta[..., None, :]
        out = torch.einsum("bhkv,bhk->bhv", state, q)
        return out.to(out_dtype), state

    def chunk(self, q, k, v, g, beta, state):
        """UT-transform form: within a chunk of C tokens the delta-rule updates become a triangular
        solve and a few matmuls; chunks run in sequence, carrying the state."""
        out_dtype = v.dtype
        length, num_heads, c = v.shape[0], v.shape[1], self.chunk_size
        q, k, v = _prepare(q, k, v, num_heads)
        # [L, H, ...] -> [H, N, C, ...], zero-padded to a multiple of C.
        pad = (c - length % c) % c
        q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)).unflatten(1, (-1, c)) for x in (q, k, v))
        g, beta = (F.pad(x.float().transpose(0, 1), (0, pad)).unflatten(1, (-1, c)) for x in (g, beta))
        k_beta, v_beta = k * beta[..., None], v * beta[..., None]
        decay = g.cumsum(-1)  # [H, N, C]: log decay from the chunk start to each position
        upper = torch.ones(c, c, dtype=torch.bool, device=v.device).triu(1)
        pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [H, N, C, C]
        system = (k_beta @ k.transpose(-1, -2)) * pair
        attn = (q @ k.transpose(-1, -2)) * pair
        new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
        k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                                  unitriangular=True)
        q = q * decay.exp()[..., None]
        k = k * (decay[..., -1:] - decay).exp()[..., None]
        chunk_decay = decay[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
        out = torch.empty_like(new_v)
        state = state.float()
        for i in range(new_v.shape[1]):
            v_i = new_v[:, i] - k_decayed[:, i] @ state
            out[:, i] = q[:, i] @ state + attn[:, i] @ v_i
            state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_i
        out = out.flatten(1, 2)[:, :length].transpose(0, 1)  # [L, H, Dv]
        return out.to(out_dtype), state

