"""The batched LoRA product of one linear layer: each token adds its own adapter's B A x to the
base layer's output, in place.

Every form takes the same slot layout (layer.py): ``a`` [L, K, in] and ``b`` [L, K, out] for
L = --max-loras slots of K rank rows (K = slices x --max-lora-rank; a fused layer's slices are
block-diagonal in ``b``, zero rows where a slot's adapter has a lower rank), ``x`` [T, in], the
base output ``y`` [T, out] in a's dtype, the step's LoRABatch and ``columns``, each slice's output
columns [(first, end)] (None: one slice over all of out); ``add`` writes y += B A x for every
adapter token (base-model tokens keep y) and returns y. Which form runs is the platform's choice
(kernel kind "lora" in platforms/kernel_choice.py), as punica's kernels are vLLM's:

    padded: segments as below; the other adapter tokens (decode) gathered once into a slot-by-slot
        layout padded to the largest slot's count (LoRABatch.padded, laid out on the host), then one
        torch.bmm for every slot's shrink, pad rows zeroed, one bmm per slice for every expand (only
        the slice's block of B) and one index_add_ back. At 32 decode tokens on 4 slots bmm takes
        both threads where torch._grouped_mm takes one: the CPU's choice. Where padding would more
        than double the rows, the step runs segmented's grouped_mm (or grouped's loop) instead.
    segmented (punica's sgmv in plain ops): a segment (a run of >= MIN_SEGMENT_ROWS rows on one
        slot, a prefill chunk) is one shrink matmul and, per slice, one addmm_ straight into its
        rows and columns of y (no zeros of the block-diagonal B, no delta tensor); the other
        adapter tokens (decode) are gathered once into slot order (LoRABatch.order, sorted on the
        host once per step), then one torch._grouped_mm for every slot's shrink, one for every
        expand, and one index_add_ back: four ops whatever the mix.
    grouped: segments as above, then one pair of matmuls per slot present (at most --max-loras),
        each added back by rows (padded's fallback where torch has no _grouped_mm or a width misfits).
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


def add_sorted_grouped_mm(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                          batch: LoRABatch) -> None:
    """y[order] += the other adapter tokens' products: two torch._grouped_mm over the rows in slot order."""
    n = batch.num_sorted
    rows = x[:n] if batch.order is None else x.index_select(0, batch.order)  # [N, in] in slot order
    h = torch._grouped_mm(rows, a.transpose(1, 2), offs=batch.offsets)  # [N, K]
    delta = torch._grouped_mm(h, b, offs=batch.offsets)  # [N, out]
    if batch.order is None:
        y[:n].add_(delta)
    else:
        y.index_add_(0, batch.order, delta)


def add_per_slot(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch) -> None:
    """y[rows] += the other adapter tokens' products, one matmul pair per slot present."""
    for slot, rows in batch.groups:
        y.index_add_(0, rows, (x.index_select(0, rows) @ a[slot].t()) @ b[slot])


def add_padded(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch,
               columns: Columns) -> None:
    """y[rows] += the other adapter tokens' products as torch.bmm over the padded slots (P =
    end_slot - first_slot slots of M rows; batch.padded is not None): one shrink, then one expand
    per slice reading only that slice's block of B (not the block-diagonal zeros, a third of a
    decode step's LoRA bytes), each written into its columns of one delta."""
    padded = batch.padded
    slots = slice(padded.first_slot, padded.end_slot)
    size = (padded.end_slot - padded.first_slot) * padded.rows_per_slot
    rows = x[:size] if padded.rows is None else x.index_select(0, padded.rows)  # [P M, in]
    h = torch.bmm(rows.reshape(-1, padded.rows_per_slot, x.shape[1]), a[slots].transpose(1, 2))  # [P, M, K]
    if padded.pads is not None:
        h.masked_fill_(padded.pads, 0)  # a pad reads row 0: its product must add nothing
    if columns is None:
        delta = torch.bmm(h, b[slots]).view(size, -1)  # [P M, out]
    else:
        delta = h.new_empty(size, b.shape[2])
        rank = h.shape[2] // len(columns)
        for s, (start, end) in enumerate(columns):  # [P, M, r] x [P, r, end - start] into delta's columns
            k = slice(s * rank, (s + 1) * rank)
            torch.bmm(h[:, :, k], b[slots, k, start:end], out=delta.view(h.shape[0], -1, b.shape[2])[:, :, start:end])
    if padded.rows is None:
        y[:size].add_(delta)
    else:
        y.index_add_(0, padded.rows, delta)


class PaddedLoRA:
    name = "padded"

    def add(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch,
            columns: Columns = None) -> torch.Tensor:
        add_segments(x, y, a, b, batch, columns)
        if batch.padded is not None:
            add_padded(x, y, a, b, batch, columns)
        elif batch.num_sorted and hasattr(torch, "_grouped_mm") and grouped_mm_fits(a, b):
            add_sorted_grouped_mm(x, y, a, b, batch)
        elif batch.num_sorted:
            add_per_slot(x, y, a, b, batch)
        return y


class SegmentedLoRA:
    name = "segmented"

    def add(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch,
            columns: Columns = None) -> torch.Tensor:
        if not grouped_mm_fits(a, b):  # an odd width (e.g. a tensor-parallel split): the loop per slot
            return GroupedLoRA().add(x, y, a, b, batch, columns)
        add_segments(x, y, a, b, batch, columns)
        if batch.num_sorted:
            add_sorted_grouped_mm(x, y, a, b, batch)
        return y


class GroupedLoRA:
    name = "grouped"

    def add(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch,
            columns: Columns = None) -> torch.Tensor:
        add_segments(x, y, a, b, batch, columns)
        add_per_slot(x, y, a, b, batch)
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


TORCH_LORA_KERNELS = {kernel.name: kernel for kernel in (PaddedLoRA, SegmentedLoRA, GroupedLoRA, MaskedDenseLoRA,
                                                         GatheredLoRA)}
