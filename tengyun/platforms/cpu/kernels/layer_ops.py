"""RMSNorm, rotary embedding and SiLU-and-mul through the compiled CPU kernels
(tengyun/csrc/layer_ops.cpp): one pass over memory per op instead of PyTorch's several, with
no float32 copies of a bf16 activation (``benchmarks/README.md``, "Fused layer ops").

Same arithmetic as ``TorchLayerOps``: float32 inside, rounded where the PyTorch expression
rounds, so bf16 results are bit-equal up to float32 summation order and the last bit of exp
(``tests/layers/test_cpu_layer_ops.py``). Rotary turns q and k in place.

``CpuPlatform.layer_ops`` picks these only when the kernel library loads
(``tengyun.platforms.cpu.native``); otherwise the PyTorch ops run.
"""

from __future__ import annotations

import torch

from tengyun.layers.layer_ops import TorchLayerOps


class CpuFusedLayerOps(TorchLayerOps):
    """The library must be loaded (cpu_kernels.load_error() is None) before this is made."""

    def __init__(self):
        # The ops' overloads, resolved once: a call through the packet costs ~0.6 us more, and a
        # batch-1 decode step makes ~150 of these calls.
        self.ops = _Overloads(torch.ops.tengyun, "rms_norm", "add_rms_norm", "rotary_neox_", "rotary_neox_at_",
                              "silu_and_mul")

    def rms_norm(self, x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ops.rms_norm(x, gamma, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.add_rms_norm(x, residual, gamma, eps)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """In place: q [T, Hq, R] and k [T, Hkv, R] views (unit last stride) are rotated where
        they lie and returned; cos, sin [T, 1, R / 2] float32."""
        if q.dtype != k.dtype or q.stride(-1) != 1 or k.stride(-1) != 1:
            return super().rotary(q, k, cos, sin)
        tokens = q.shape[0]
        self.ops.rotary_neox_(q, k, cos.reshape(tokens, -1).contiguous(), sin.reshape(tokens, -1).contiguous())
        return q, k

    def rotary_at(self, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """In place, as ``rotary``, reading the table rows at positions inside the kernel (no
        gathered cos/sin per layer)."""
        if q.dtype != k.dtype or q.stride(-1) != 1 or k.stride(-1) != 1 or not cos_table.is_contiguous() \
                or not sin_table.is_contiguous() or positions.dtype != torch.int64:
            return super().rotary_at(q, k, cos_table, sin_table, positions)
        self.ops.rotary_neox_at_(q, k, cos_table, sin_table, positions.contiguous())
        return q, k

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)


class _Overloads:
    """name -> the op's default overload, as attributes."""

    def __init__(self, namespace, *names: str):
        for name in names:
            setattr(self, name, getattr(namespace, name).default)
