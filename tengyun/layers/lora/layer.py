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
    def __init__(self, in_features: int, out_features: int, columns: list[tuple[int, int]], num_slots: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device, kernel):
        """``columns``: each slice's output columns [first, end) on this rank, in slice order
        (qkv_proj of SmolLM2 at TP 1: [(0, 576), (576, 768), (768, 960)])."""
        rows = len(columns) * max_rank
        self.columns = columns if len(columns) > 1 else None  # None: one slice over every output
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
        """y [T, out] (the base layer's fresh output, or this rank's partial sum) plus each token's
        adapter product from x [T, in], written into y itself when y is in the slots' dtype
        (--lora-dtype auto); y untouched outside a step with adapter tokens."""
        batch = current_lora_batch()
        if batch is None:
            return y
        x = x.to(self.a.dtype)
        if y.dtype == self.a.dtype:
            return self.kernel.add(x, y, self.a, self.b, batch, self.columns)
        delta = self.kernel.add(x, x.new_zeros(y.shape), self.a, self.b, batch, self.columns)
        return y + delta.to(y.dtype)

    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()
