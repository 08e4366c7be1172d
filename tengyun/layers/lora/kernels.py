"""The batched LoRA product of one linear layer: each token adds its own adapter's B A x to the
base layer's output, in place.

Every form takes the same slot layout (layer.py): ``a`` [L, K, in] and ``b`` [L, K, out] for
L = --max-loras slots of K rank rows (K = slices x --max-lora-rank; a fused layer's slices are
block-diagonal in ``b``, zero rows where a slot's adapter has a lower rank), ``x`` [T, in], the
base output ``y`` [T, out] in a's dtype, the step's LoRABatch and ``columns``, each slice's output
columns [(first, end)] (None: one slice over all of out); ``add`` writes y += B A x for every
adapter token (base-model tokens keep y) and returns y. Which form runs is the platform's choice
(kernel kind "lora" in platforms/kernel_choice.py), as punica's kernels are vLLM's:

    segmented (punica's sgmv in plain ops): a segment (a run of >= MIN_SEGMENT_ROWS rows on one
        slot, a prefill chunk) is one shrink matmul and, per slice, one addmm_ straight into its
        rows and columns of y (no zeros of the block-diagonal B, no delta tensor); the other
        adapter tokens (decode) are gathered once into slot order (LoRABatch.order, sorted on the
        host once per step), then one torch._grouped_mm for every slot's shrink, one for every
        expand, and one index_add_ back: four ops whatever the mix. The CPU's choice.
    grouped: segments as above, then one pair of matmuls per slot present (at most --max-loras),
        each added back by rows: the CPU's choice on a torch without _grouped_mm.
    masked_dense (bgmv's effect in two matmuls): h = x @ A_all^T [T, L*K], zeroed outside each
        token's slot, then y += h @ B_all. L times the needed FLOPs, but two GEMMs whatever the mix,
        no gathers and no host sync: the generic form (accelerators).
    gathered (bgmv as written, vLLM's CPU form): each token's A and B gathered ([T, K, in]), then two
        batched matmuls; memory grows with T x K x in, 20-60x slower here: kept for the comparison only.

Measured in benchmarks/lora.py; docs/lora.md has the figures.
"""

from __future__ import annotations

import torch

from tengyun.layers.lora.batch import LoRABatch

Columns = list[tuple[int, int]] | None  # each slice's output columns [first, end), in slice order


def add_segments(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch,
                 columns: Columns) -> None:
    """y[rows] += (x[rows] A^T) B for each segment, slice by slice into that slice's columns."""
    for slot, first, count in batch.segments:
        rows = slice(first, first + count)
        h = x[rows] @ a[slot].t()  # [n, K]
        if columns is None:
            y[rows].addmm_(h, b[slot])
            continue
        rank = h.shape[1] // len(columns)
        for s, (start, end) in enumerate(columns):
            k = slice(s * rank, (s + 1) * rank)
            y[rows, start:end].addmm_(h[:, k], b[slot, k, start:end])


def grouped_mm_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch._grouped_mm takes rows whose strides are multiples of 16 bytes: in, K and out elements."""
    return all(size * a.element_size() % 16 == 0 for size in (a.shape[2], a.shape[1], b.shape[2]))


class SegmentedLoRA:
    name = "segmented"

    def add(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch,
            columns: Columns = None) -> torch.Tensor:
        if not grouped_mm_fits(a, b):  # an odd width (e.g. a tensor-parallel split): the loop per slot
            return GroupedLoRA().add(x, y, a, b, batch, columns)
        add_segments(x, y, a, b, batch, columns)
        n = batch.num_sorted
        if not n:
            return y
        rows = x[:n] if batch.order is None else x.index_select(0, batch.order)  # [N, in] in slot order
        h = torch._grouped_mm(rows, a.transpose(1, 2), offs=batch.offsets)  # [N, K]
        delta = torch._grouped_mm(h, b, offs=batch.offsets)  # [N, out]
        if batch.order is None:
            y[:n].add_(delta)
            return y
        return y.index_add_(0, batch.order, delta)


class GroupedLoRA:
    name = "grouped"

    def add(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch,
            columns: Columns = None) -> torch.Tensor:
        add_segments(x, y, a, b, batch, columns)
        for slot, rows in batch.groups:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a[slot].t()) @ b[slot])
        return y


class MaskedDenseLoRA:
    name = "masked_dense"

    def add(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch,
            columns: Columns = None) -> torch.Tensor:
        num_slots, k, in_ = a.shape
        h = x @ a.view(num_slots * k, in_).t()  # [T, L*K]
        h.mul_(batch.column_mask(k, h.dtype))
        return y.addmm_(h, b.view(num_slots * k, -1))


class GatheredLoRA:
    name = "gathered"

    def add(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch,
            columns: Columns = None) -> torch.Tensor:
        slots = batch.token_slots.clamp(min=0)
        h = torch.bmm(a[slots], x[:, :, None])  # [T, K, 1]
        h = h * (batch.token_slots >= 0).to(h.dtype)[:, None, None]
        return y.add_(torch.bmm(b[slots].transpose(1, 2), h).squeeze(-1))  # [T, out]


TORCH_LORA_KERNELS = {kernel.name: kernel for kernel in (SegmentedLoRA, GroupedLoRA, MaskedDenseLoRA, GatheredLoRA)}
