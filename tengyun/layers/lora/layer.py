"""LinearLoRA: one targeted linear layer's adapter slots on this rank, and the product it adds.

    a [L, K, in]   slot l's A rows; K = slices x R (R = --max-lora-rank), slice s in rows [s R, s R + r)
    b [L, K, out]  slot l's B, transposed and times the adapter's scaling; slice s's rows hold only
                   that slice's output columns (block-diagonal: q's B never writes k or v)

A qkv_proj has 3 slices (q, k, v), gate_up_proj 2, o_proj and down_proj 1. A slot whose adapter
leaves a module out, or has a rank r < R, holds zeros there: it adds nothing.

Tensor parallel, as the base layer is split: a column-parallel layer (qkv, gate_up) keeps every
A row and this rank's B columns; a row-parallel one (o, down) keeps this rank's A inputs and all
of B, and adds its partial product before the layer's all-reduce sums the ranks.
"""

from __future__ import annotations

import torch

from tengyun.layers.lora.batch import current_lora_batch


class LinearLoRA:
    def __init__(self, in_features: int, out_features: int, num_slices: int, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, kernel):
        rows = num_slices * max_rank
        self.a = torch.zeros(num_slots, rows, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, rows, out_features, dtype=dtype, device=device)
        self.kernel = kernel  # the platform's "lora" choice (kernels.py)

    def write(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Fill ``slot`` with an adapter's a [K, in] and b [K, out]; None: it leaves this layer alone."""
        if a is None:
            self.a[slot].zero_()
            self.b[slot].zero_()
            return
        self.a[slot].copy_(a)
        self.b[slot].copy_(b)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] (the base layer's output, or this rank's partial sum) plus each token's adapter
        product from x [T, in]; y itself outside a step with adapter tokens."""
        batch = current_lora_batch()
        if batch is None:
            return y
        delta = self.kernel.apply(x.to(self.a.dtype), self.a, self.b, batch)
        return y + delta.to(y.dtype)

    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()
