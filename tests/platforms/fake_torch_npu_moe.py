"""The MoE ops of the torch_npu stand-in (fake_torch_npu.py, whose module docstring says what it
checks and what it cannot), each as strict as its op-plugin document."""

from __future__ import annotations

import torch

from fake_torch_npu import _FLOATS, _require, _unused


# ----- MoE (op-plugin docs/context/torch_npu-npu_moe_*.md, custom_APIs/torch_npu-npu_grouped_matmul.md)
# torch_npu-npu_moe_gating_top_k_softmax.md: x [T, E] (2-D here) float16 / bfloat16 / float32, 0 < k <= E,
# k <= 1024 -> y = topk(softmax(x)) in x's dtype, expert_idx int32, row_idx int32 with
# row_idx = arange(T * k).reshape(k, T).T.
def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    _unused(finished=finished)
    _require(x.dtype in _FLOATS and x.dim() == 2, f"x float16 / bfloat16 / float32 [T, E], not {x.dtype} {x.dim()}-D")
    _require(0 < k <= x.shape[-1] and k <= 1024, f"k ({k}) must lie in (0, E = {x.shape[-1]}] and be <= 1024")
    y, expert_idx = torch.topk(torch.softmax(x.float(), dim=-1), k, dim=-1)
    row_idx = torch.arange(x.shape[0] * k, dtype=torch.int32).reshape(k, x.shape[0]).t()
    return y.to(x.dtype), expert_idx.to(torch.int32), row_idx


# torch_npu-npu_moe_init_routing.md: x [T, H] float; row_idx, expert_idx int32 [T, k];
# expanded_expert_idx, sorted_row_idx = keyValueSort(expert_idx, row_idx) (by expert, then row);
# expanded_row_idx[sorted_row_idx[i]] = i; expanded_x[i] = x[sorted_row_idx[i] % T], the first
# min(T, active_num) * k rows.
def npu_moe_init_routing(x, row_idx, expert_idx, active_num):
    _require(x.dtype in _FLOATS and x.dim() == 2, "x float16 / bfloat16 / float32 [T, H]")
    _require(expert_idx.dtype == row_idx.dtype == torch.int32, "row_idx and expert_idx int32")
    _require(expert_idx.dim() == 2 and row_idx.shape == expert_idx.shape and expert_idx.shape[0] == x.shape[0],
             "row_idx and expert_idx [T, k]")
    rows, experts = row_idx.flatten().long(), expert_idx.flatten().long()
    by_row = torch.argsort(rows, stable=True)
    by_expert = by_row[torch.argsort(experts[by_row], stable=True)]  # expert first, then row
    sorted_row_idx = rows[by_expert]
    expanded_row_idx = torch.empty_like(sorted_row_idx)
    expanded_row_idx[sorted_row_idx] = torch.arange(rows.numel())
    kept = min(x.shape[0], active_num) * expert_idx.shape[1]
    expanded_x = x[sorted_row_idx % x.shape[0]][:kept]
    return expanded_x, expanded_row_idx.to(torch.int32), experts[by_expert].to(torch.int32)


# torch_npu-npu_moe_compute_expert_tokens.md: sorted int32 1-D -> [num_expert] int32, the end row of each
# expert (binary search for its last row).
def npu_moe_compute_expert_tokens(sorted_expert_for_source_row, num_expert):
    ids = sorted_expert_for_source_row
    _require(ids.dtype == torch.int32 and ids.dim() == 1, "sorted_expert_for_source_row int32 1-D")
    _require(bool((ids[1:] >= ids[:-1]).all()), "sorted_expert_for_source_row must be sorted")
    return torch.searchsorted(ids, torch.arange(num_expert, dtype=torch.int32), right=True).to(torch.int32)


# torch_npu-npu_grouped_matmul.md (op-plugin docs/context/), m-axis groups with one tensor each (split_item
# 2/3, group_type 0): x [M, K], weight [E, K, N] contiguous, group_list int64 [E] (type 0: cumulative ends,
# non-decreasing; 1: sizes), K and N < 65536 -> [y [M, N]]: rows of group e through weight[e]. Rows past
# the last group are not written (the document says nothing of them): NaN here. Its data-type table
# (group_list a Tensor, Atlas A2/A3) in the three forms emulated:
# - not quantised: x and weight of one float dtype, y = x @ w, y in x's dtype;
# - per-token quantised (W8A8): x int8, weight int8, scale [E, N] bfloat16 with output_dtype bfloat16 or
#   float32 with float16, per_token_scale float32 [M]: y = (x @ w) * scale[e] * per_token_scale;
# - weight-only (antiquant): x float16 / bfloat16, weight int8 per channel: antiquant_scale [E, N] of x's
#   dtype, antiquant_offset None or the same: y = x @ ((w + offset[e]) * scale[e]) in x's dtype.
def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       output_dtype=None, tuning_config=None):
    _unused(bias=bias, offset=offset, activation_input=activation_input,
            activation_quant_scale=activation_quant_scale, activation_quant_offset=activation_quant_offset,
            tuning_config=tuning_config)
    _require(split_item in (2, 3) and group_type == 0 and act_type == 0, "emulated: split_item 2/3, group_type 0")
    _require(len(x) == 1 and len(weight) == 1, "emulated: one x and one weight tensor")
    rows, w = x[0], weight[0]
    _require(rows.dim() == 2 and w.dim() == 3 and w.shape[1] == rows.shape[1], "x [M, K], weight [E, K, N]")
    _require(w.is_contiguous(), "weight [E, K, N] contiguous (ND)")
    _require(max(w.shape[1:]) < 65536, "K and N below InnerLimit 65536")
    ends = _group_ends(group_list, group_list_type, w.shape[0], rows.shape[0])
    per_expert, out_dtype = _grouped_form(rows, w, scale, per_token_scale, antiquant_scale, antiquant_offset,
                                          output_dtype)
    y = torch.full((rows.shape[0], w.shape[2]), float("nan"), dtype=out_dtype)
    start = 0
    for e, end in enumerate(ends.tolist()):
        y[start:end] = per_expert(e, slice(start, end)).to(out_dtype)
        start = end
    return [y]


def _group_ends(group_list, group_list_type: int, experts: int, rows: int) -> torch.Tensor:
    _require(isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64
             and group_list.shape == (experts,), "group_list int64 [E]")
    _require(group_list_type in (0, 1), "emulated: group_list_type 0 or 1")
    ends = group_list if group_list_type == 0 else group_list.cumsum(0)
    _require(bool((group_list >= 0).all()) and bool((ends[1:] >= ends[:-1]).all()), "group_list non-decreasing")
    _require(int(ends[-1]) <= rows, "group_list ends past x's rows")
    return ends


def _grouped_form(rows, w, scale, per_token_scale, antiquant_scale, antiquant_offset, output_dtype):
    """(expert e, its row slice -> its rows' float32 product, y's dtype) for the table's row this call is."""
    experts, n = w.shape[0], w.shape[2]
    if scale is not None or per_token_scale is not None:  # per-token quantised
        _unused(antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset)
        _require(rows.dtype == torch.int8 and w.dtype == torch.int8, "per-token quantised: x and weight int8")
        s, t = scale[0], per_token_scale[0]
        _require((s.dtype, output_dtype) in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)),
                 f"per-token quantised: scale bfloat16 with output_dtype bfloat16, or float32 with float16; not "
                 f"{s.dtype} with {output_dtype}")
        _require(s.shape == (experts, n), "scale [E, N]")
        _require(t.dtype == torch.float32 and t.shape == (rows.shape[0],), "per_token_scale float32 [M]")
        return (lambda e, r: (rows[r].float() @ w[e].float()) * s[e].float() * t[r].unsqueeze(1)), output_dtype
    if antiquant_scale is not None:  # weight-only
        _require(rows.dtype in (torch.float16, torch.bfloat16) and w.dtype == torch.int8,
                 "weight-only: x float16 / bfloat16, weight int8")
        a_s = antiquant_scale[0]
        a_o = None if antiquant_offset is None else antiquant_offset[0]
        _require(a_s.dtype == rows.dtype and a_s.shape == (experts, n), "int8 weight: per channel, antiquant_scale "
                 "[E, N] of x's dtype")
        _require(a_o is None or (a_o.dtype == a_s.dtype and a_o.shape == a_s.shape), "antiquant_offset as the scale")
        _require(output_dtype in (None, rows.dtype), "weight-only: output_dtype None or x's dtype")

        def weight_only(e, r):
            deq = w[e].float() if a_o is None else w[e].float() + a_o[e].float()
            return rows[r].float() @ (deq * a_s[e].float())

        return weight_only, rows.dtype
    _require(rows.dtype in _FLOATS and w.dtype == rows.dtype, "x and weight of one float dtype")
    _require(output_dtype in (None, rows.dtype), "not quantised: output_dtype None or x's dtype")
    return (lambda e, r: rows[r].float() @ w[e].float()), rows.dtype


# torch_npu-npu_moe_finalize_routing.md, drop_pad_mode 0: expanded_permuted_rows [T * k, H], scales [T, k]
# of its dtype, expanded_src_to_dst_row int32 [T * k] in [0, T * k - 1]:
# out[i] = skip1 + skip2 + sum_j scales[i, j] * (rows[src_to_dst[i + j * T]] + bias[expert]).
def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0):
    _unused(skip1=skip1, skip2=skip2, bias=bias)
    rows, dst = expanded_permuted_rows, expanded_src_to_dst_row
    _require(drop_pad_mode == 0, "emulated: drop_pad_mode 0")
    _require(rows.dtype in _FLOATS and rows.dim() == 2, "expanded_permuted_rows float [T * k, H]")
    _require(scales.dtype == rows.dtype and scales.dim() == 2, "scales [T, k] of the rows' dtype")
    tokens, k = scales.shape
    _require(dst.dtype == torch.int32 and dst.shape == (tokens * k,) and rows.shape[0] == tokens * k,
             "expanded_src_to_dst_row int32 [T * k]")
    _require(bool(((dst >= 0) & (dst < tokens * k)).all()), "expanded_src_to_dst_row within [0, T * k - 1]")
    picked = rows.float()[dst.long()].view(k, tokens, -1)  # [j, i, H] = rows[src_to_dst[i + j * T]]
    return (scales.float().t().unsqueeze(-1) * picked).sum(0).to(rows.dtype)


OPS = (npu_moe_gating_top_k_softmax, npu_moe_init_routing, npu_moe_compute_expert_tokens, npu_grouped_matmul,
       npu_moe_finalize_routing)
