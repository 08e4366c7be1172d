"""The gated delta rule through flash-linear-attention's Triton kernels (CUDA).

NOT YET RUN ON A GPU: written against fla's documented API (fla-core 0.6.0; the same call fits
flash-linear-attention 0.2.0 on, whose ops ship as fla-core from 0.3.2) and checked on CPU by
pointing it at fla's own pure-PyTorch references in place of the Triton kernels
(tests/layers/fla_reference_checks.py).

Mapping from ``GatedDeltaRuleKernel`` (tengyun/layers/gated_delta_rule.py) to fla:
- layout: fla takes [B, T, H, D]; a prefill chunk is B = 1, T = L; a decode batch is B
  sequences of T = 1 each.
- q/k: fla l2-normalises them in-kernel (``use_qk_l2norm_in_kernel``: x / sqrt(sum(x^2) + 1e-6),
  our ``l2norm``) and scales q by ``scale`` = Dk^-0.5 after normalising, as our kernel does.
- key heads: repeated over their Hv / Hk consecutive value heads before the call, as our
  kernel does (fla's own grouped-value support only exists in newer releases).
- state: fla's ``initial_state`` / final state are [N, Hv, Dk, Dv] float32 (the default
  ``state_v_first=False``), our [Hv, Dk, Dv] with N = 1, or [B, Hv, Dk, Dv] for decodes.
- ``fused_recurrent_gated_delta_rule`` takes ``gk`` and ``gv`` before ``beta`` from 0.3.0 on:
  every argument after v is passed by name.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch


def fla_import_error() -> str | None:
    """None when fla's gated-delta-rule kernels import and take our call, else why not."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # ImportError, or triton failing to initialise
        return f"fla does not import: {type(e).__name__}: {e}"
    head_first = inspect.signature(chunk_gated_delta_rule).parameters.get("head_first")
    if head_first is not None and head_first.default is True:  # flash-linear-attention < 0.2
        return ("the installed fla expects [B, H, T, D] (head_first=True by default): "
                "install fla-core (flash-linear-attention>=0.2)")
    return None


class FlaGatedDeltaRule:
    """``chunk_fn`` / ``recurrent_fn`` default to fla's Triton kernels; tests pass fla's
    pure-PyTorch reference instead, so only the callee changes."""

    def __init__(self, chunk_fn: Callable | None = None, recurrent_fn: Callable | None = None):
        if chunk_fn is None or recurrent_fn is None:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

            chunk_fn = chunk_fn or chunk_gated_delta_rule
            recurrent_fn = recurrent_fn or fused_recurrent_gated_delta_rule
        self.chunk_fn, self.recurrent_fn = chunk_fn, recurrent_fn

    def chunk(self, q, k, v, g, beta, state):
        """One sequence of L tokens: one fla call on B = 1, T = L."""
        q, k = _repeat_key_heads(q, k, v.shape[-2])
        out, state = self.chunk_fn(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0).contiguous(), g=g.unsqueeze(0), beta=beta.unsqueeze(0),
            scale=q.shape[-1] ** -0.5, initial_state=state.float().unsqueeze(0), output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        return out[0].to(v.dtype), state[0]

    def recurrent(self, q, k, v, g, beta, state):
        """One token each of B sequences: one fla call on B sequences of T = 1."""
        q, k = _repeat_key_heads(q, k, v.shape[-2])
        out, state = self.recurrent_fn(
            q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1).contiguous(), g=g.unsqueeze(1), beta=beta.unsqueeze(1),
            scale=q.shape[-1] ** -0.5, initial_state=state.float().contiguous(), output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        return out[:, 0].to(v.dtype), state


def _repeat_key_heads(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., Hk, D] -> [..., Hv, D], contiguous: key head i serves value heads i*r .. i*r + r - 1."""
    repeat = num_v_heads // q.shape[-2]
    if repeat > 1:
        return q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)
    return q.contiguous(), k.contiguous()
