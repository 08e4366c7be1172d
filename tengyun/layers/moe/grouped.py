"""The experts of one FusedMoE layer as grouped matmuls: the PyTorch kernels of op kind "moe".

A kernel takes the router logits and the tokens and returns this rank's part of the layer's output
(its experts' weighted sum; the layer reduces over ranks):
    route(router_logits [T, E], top_k, renormalize) -> weights [T, k], ids [T, k]
    experts(x [T, H], weights [T, k], ids [T, k], first, w13 [E_local, 2I, H], w2 [E_local, H, I]) -> [T, H]
    prepare(w13, w2) -> (w13, w2): the same logical shapes, stored as the kernel reads them (once, at bind)
``host_sync``: whether ``experts`` reads a tensor back to the host (it then cannot be recorded in a
decode graph). Platforms list theirs in kernel_choice's "moe" table; unbound layers use
TorchGroupedMoe.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tengyun.layers.moe.routing import ExpertOrder, route, sort_by_expert


def unpermute(out: torch.Tensor, weights: torch.Tensor, groups: ExpertOrder, num_tokens: int) -> torch.Tensor:
    """out [T * k, H] (sorted rows; rows of other ranks' experts hold anything, even NaN) ->
    sum over each token's local experts of weight * row, [T, H] in out's dtype."""
    scale = weights.flatten()[groups.order].to(out.dtype).unsqueeze(1)  # [T * k, 1]
    out = torch.where(groups.local.unsqueeze(1), out * scale, 0)
    return out.new_zeros(num_tokens, out.shape[1]).index_add_(0, groups.tokens, out)


class TorchGroupedMoe:
    """torch._grouped_mm over the rows sorted by expert: two grouped matmuls per layer, the group
    sizes a device tensor (offsets [E_local] int32, cumulative). Exact against a loop of F.linear
    per expert on CPU (the same matmul per group)."""

    name = "torch_grouped_mm"
    host_sync = False

    def prepare(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return w13, w2  # read through transposed views: no copy

    def route(self, router_logits: torch.Tensor, top_k: int, renormalize: bool):
        return route(router_logits, top_k, renormalize)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, first: int,
                w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        stacks = {"w13": w13, "w2": w2}
        return grouped_experts(x, weights, ids, first, w13.shape[0],
                               lambda stack, rows, ends: grouped_mm(rows, stacks[stack], ends))


def grouped_mm(rows: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows [R, in] sorted by expert, w [E, out, in], ends [E] -> [R, out] (rows past ends[-1]: unset)."""
    return torch._grouped_mm(rows, w.transpose(1, 2), offs=ends.to(torch.int32))


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, first: int, num_local: int,
                    stack: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Each stack once over all the sorted rows: ``stack(name, rows [R, in], ends)`` runs expert e's
    rows (ends[e - 1] .. ends[e] - 1; ends int64 [E_local], cumulative, on the device) through
    its "w13" or "w2" -> [R, out], rows past ends[-1] holding anything. No host read."""
    groups = sort_by_expert(ids, first, num_local)
    ends = groups.counts.cumsum(0)  # [E_local]: end row of each local expert
    rows = x[groups.tokens]  # [T * k, H]
    gate, up = stack("w13", rows, ends).chunk(2, dim=-1)
    out = stack("w2", F.silu(gate) * up, ends)
    return unpermute(out, weights, groups, x.shape[0])


def loop_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, first: int, num_local: int,
                 expert: Callable[[str, int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One matmul pair per local expert with tokens (never per token): ``expert(stack, local,
    rows)`` runs rows [N, in] through local expert ``local``'s "w13" or "w2". Reads the counts on
    the host once (the row ranges are Python slices): where no grouped kernel exists."""
    groups = sort_by_expert(ids, first, num_local)
    rows = x[groups.tokens]
    out = torch.zeros_like(rows)
    start = 0
    for local, count in enumerate(groups.counts.tolist()):
        if count:
            part = slice(start, start + count)
            gate, up = expert("w13", local, rows[part]).chunk(2, dim=-1)
            out[part] = expert("w2", local, F.silu(gate) * up)
            start += count
    return unpermute(out, weights, groups, x.shape[0])


class LoopMoe(TorchGroupedMoe):
    """The per-expert loop (loop_experts) with F.linear: the last candidate, for a torch without
    _grouped_mm."""

    name = "torch_loop"
    host_sync = True

    def experts(self, x, weights, ids, first, w13, w2):
        stacks = {"w13": w13, "w2": w2}
        return loop_experts(x, weights, ids, first, w13.shape[0],
                            lambda stack, local, rows: F.linear(rows, stacks[stack][local]))
