"""The batched LoRA product of one linear layer: each token adds its own adapter's B A x.

Every form takes the same slot layout (layer.py): ``a`` [L, K, in] and ``b`` [L, K, out] for
L = --max-loras slots of K rank rows (K = slices x --max-lora-rank; a fused layer's slices are
block-diagonal in ``b``, zero rows where a slot's adapter has a lower rank), ``x`` [T, in] and
the step's LoRABatch; -> delta [T, out], zero on base-model tokens. Which form runs is the
platform's choice (kernel kind "lora" in platforms/kernel_choice.py), as punica's kernels are
vLLM's:

    masked_dense (bgmv's effect in two matmuls): h = x @ A_all^T [T, L*K], zeroed outside each
        token's slot, then h @ B_all. L times the needed FLOPs, but two GEMMs whatever the mix,
        no gathers and no host sync: the generic form (accelerators).
    grouped (sgmv): tokens grouped by slot, one pair of GEMMs per slot present in the batch
        (at most --max-loras): the CPU's choice, measured fastest in float32 at 1 to 256 tokens
        (4 slots, rank 16, gate_up of Qwen2.5-0.5B: 0.07 vs 0.16 ms at 1 token, 1.0 vs 1.7 ms at
        32; even at 1,024; benchmarks/lora.py).
    gathered (bgmv as written): each token's A and B gathered ([T, K, in]), then two batched
        matmuls; memory grows with T x K x in, 20-60x slower here: kept for the comparison only.
"""

from __future__ import annotations

import torch

from tengyun.layers.lora.batch import LoRABatch


class MaskedDenseLoRA:
    name = "masked_dense"

    def apply(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        num_slots, k, in_ = a.shape
        h = x @ a.view(num_slots * k, in_).t()  # [T, L*K]
        h = h * batch.column_mask(k, h.dtype)
        return h @ b.view(num_slots * k, -1)  # [T, out]


class GroupedLoRA:
    name = "grouped"

    def apply(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        groups = batch.groups
        if len(groups) == 1 and len(groups[0][1]) == len(x):  # every token on one adapter: no gather
            return (x @ a[groups[0][0]].t()) @ b[groups[0][0]]
        out = x.new_zeros(x.shape[0], b.shape[-1])
        for slot, rows in groups:
            out.index_copy_(0, rows, (x.index_select(0, rows) @ a[slot].t()) @ b[slot])
        return out


class GatheredLoRA:
    name = "gathered"

    def apply(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        slots = batch.token_slots.clamp(min=0)
        h = torch.bmm(a[slots], x[:, :, None])  # [T, K, 1]
        h = h * (batch.token_slots >= 0).to(h.dtype)[:, None, None]
        return torch.bmm(b[slots].transpose(1, 2), h).squeeze(-1)  # [T, out]


TORCH_LORA_KERNELS = {kernel.name: kernel for kernel in (MaskedDenseLoRA, GroupedLoRA, GatheredLoRA)}
