"""Qwen3-Next text model: Qwen3.5's hybrid layers (Gated DeltaNet + gated, partially rotary full
attention, zero-centred norms) with a sparse MoE block (routed experts plus a gated shared expert)
on every ``decoder_sparse_step``-th layer outside ``mlp_only_layers``, a dense MLP elsewhere.

The checkpoint packs each Gated DeltaNet's projections per key-head group (HF's
``fix_query_key_value_ordering``); ``checkpoint_transform`` unpacks them at load time into
Qwen3.5's tensors (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), so the layers are Qwen3.5's.
``layer_types`` may be absent from config.json: every ``full_attention_interval``-th layer is full.
"""

from __future__ import annotations

import torch
from torch import nn

from tengyun.layers.fused_moe import FusedMoE
from tengyun.model_spec import ModelSpec
from tengyun.models.llama import make_dense_mlp
from tengyun.models.qwen3_5 import Qwen3_5ForCausalLM
from tengyun.models.qwen3_5_moe import Qwen3_5MoeSparseMoeBlock


class Qwen3NextSparseMoeBlock(Qwen3_5MoeSparseMoeBlock):
    """Qwen3.5-MoE's block; the top-k routing weights sum to 1 only with norm_topk_prob (default true)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__(spec, dtype)
        self.experts.renormalize = bool(spec.hf.get("norm_topk_prob", True))


def make_next_mlp(spec: ModelSpec, layer_idx: int, dtype: torch.dtype) -> nn.Module:
    """The MLP of decoder layer ``layer_idx``; MTP layer j (``num_layers + j``) follows layer j's
    rule, as vLLM's Qwen3-Next MTP numbers its layers (mtp.layers.j): on the releases, MoE."""
    if layer_idx >= spec.num_layers:
        layer_idx -= spec.num_layers
    if spec.sparse_layers[layer_idx]:
        return Qwen3NextSparseMoeBlock(spec, dtype)
    return make_dense_mlp(spec, layer_idx, dtype)


def split_qkvz(w: torch.Tensor, num_k_heads: int, k_dim: int, group_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj_qkvz [Hk * (2 Dk + 2 G), hidden], rows per key head g: [q_g Dk | k_g Dk | v_g G | z_g G]
    (G = Hv / Hk * Dv) -> in_proj_qkv [2 Hk Dk + Hv Dv, hidden] (all q | all k | all v) and in_proj_z
    [Hv Dv, hidden]. Hk 2, Dk 1, G 2: [q0 k0 v0 v0' z0 z0' q1 k1 v1 v1' z1 z1']
    -> qkv [q0 q1 k0 k1 v0 v0' v1 v1'], z [z0 z0' z1 z1']."""
    q, k, v, z = w.unflatten(0, (num_k_heads, -1)).split([k_dim, k_dim, group_v, group_v], dim=1)
    return torch.cat([q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)]), z.flatten(0, 1)


def split_ba(w: torch.Tensor, num_k_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj_ba [2 Hv, hidden], rows per key head g: [b_g (Hv / Hk) | a_g (Hv / Hk)] -> in_proj_b,
    in_proj_a [Hv, hidden] each. Hk 2, Hv 4: [b0 b1 a0 a1 b2 b3 a2 a3] -> b [b0 b1 b2 b3], a [a0 a1 a2 a3]."""
    b, a = w.unflatten(0, (num_k_heads, -1)).chunk(2, dim=1)
    return b.flatten(0, 1), a.flatten(0, 1)


# The checkpoint tensors of a fused Gated DeltaNet projection, by their last name: the dense weight,
# and compressed-tensors' (`tengyun quantize`, llm-compressor) rows of packed or int8 weights with
# their per-row scales and zero points; weight_shape [out, in] is rewritten per part.
_ROW_TENSORS = ("weight", "weight_packed", "weight_scale", "weight_zero_point")
# AWQ's and GPTQ's, whose outputs are the last dim: scales [groups, out], qweight [in / 8, out]
# (GPTQ) or [in, out / 8] (AWQ), qzeros [groups, out * bits / 32]. A packed word holds consecutive
# outputs, so a split at a multiple of the pack keeps every word whole. g_idx [in] serves both parts.
_COLUMN_TENSORS = ("qweight", "qzeros", "scales")
_FUSED = ("in_proj_qkvz", "in_proj_ba")


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    make_mlp = staticmethod(make_next_mlp)
    checkpoint_name_to_param = staticmethod(FusedMoE.checkpoint_name_to_param)
    # The checkpoint module a layer's quantisation is read from (layers/quantized.py), where the
    # checkpoint fuses what Tengyun runs apart.
    quant_stored_as = {"in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz",
                       "in_proj_b": "in_proj_ba", "in_proj_a": "in_proj_ba"}

    def __init__(self, spec: ModelSpec, max_position: int, dtype: torch.dtype):
        super().__init__(spec, max_position, dtype)
        linear = spec.linear_attention
        self.num_k_heads, self.num_v_heads = linear.num_key_heads, linear.num_value_heads
        self.k_dim = linear.key_head_dim
        self.group_v = self.num_v_heads // self.num_k_heads * linear.value_head_dim  # v channels per key head

    def checkpoint_transform(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """'...linear_attn.in_proj_qkvz.weight' -> in_proj_qkv and in_proj_z; '...linear_attn.in_proj_ba.weight'
        -> in_proj_b and in_proj_a (full tensors, Qwen3.5's layout; a quantised one's rows, scales and
        zero points alike, _ROW_TENSORS, or AWQ's / GPTQ's columns, _COLUMN_TENSORS); fused 3-D experts
        per expert (FusedMoE.split_fused_experts); None (as stored) for the rest."""
        prefix, sep, leaf = name.rpartition(".linear_attn.")
        module, _, kind = leaf.partition(".")
        if not sep or module not in _FUSED:
            return FusedMoE.split_fused_experts(name, tensor)
        qkvz = module == "in_proj_qkvz"
        rows = self.num_k_heads * (2 * self.k_dim + 2 * self.group_v) if qkvz else 2 * self.num_v_heads
        names = ("in_proj_qkv", "in_proj_z") if qkvz else ("in_proj_b", "in_proj_a")
        if kind == "weight_shape":  # [out, in] -> each part's [rows, in] (the loader plans on meta tensors)
            shapes = [tensor if tensor.is_meta else torch.tensor([rows, int(tensor[1])])
                      for rows in self._part_rows(qkvz)]
            return [(f"{prefix}.linear_attn.{n}.{kind}", shape) for n, shape in zip(names, shapes)]
        if kind == "g_idx":
            return [(f"{prefix}.linear_attn.{n}.{kind}", tensor) for n in names]
        if kind in _COLUMN_TENSORS:
            parts = self._split_outputs(name, tensor.t(), qkvz, rows)
            return [(f"{prefix}.linear_attn.{n}.{kind}", t.t().contiguous()) for n, t in zip(names, parts)]
        if kind not in _ROW_TENSORS:
            raise ValueError(f"checkpoint tensor {name}: Tengyun splits {module} into {' and '.join(names)}, "
                             f"which it can do for {', '.join(_ROW_TENSORS + _COLUMN_TENSORS)} and g_idx "
                             f"(dense, compressed-tensors, AWQ, GPTQ) but not for {kind}: keep {module} unquantised")
        parts = self._split_outputs(name, tensor, qkvz, rows)
        return [(f"{prefix}.linear_attn.{n}.{kind}", t) for n, t in zip(names, parts)]

    def _split_outputs(self, name: str, tensor: torch.Tensor, qkvz: bool, outputs: int) -> tuple[torch.Tensor, ...]:
        """A fused projection's tensor with its outputs along dim 0, ``pack`` outputs to a row (1, or
        8 / 4 for AWQ's and GPTQ's 4- / 8-bit zero points) -> its two parts, the same way."""
        pack, left = divmod(outputs, tensor.shape[0]) if tensor.shape[0] else (0, 1)
        if left or not pack:
            raise ValueError(f"checkpoint tensor {name} has {tensor.shape[0]} output rows or packed words but "
                             f"config.json's linear_* sizes give {outputs} outputs: use the config.json that came "
                             f"with these weights")
        segments = (self.k_dim, self.group_v) if qkvz else (self.num_v_heads // self.num_k_heads,)
        if any(size % pack for size in segments):
            raise ValueError(f"checkpoint tensor {name} packs {pack} outputs to a word, which does not divide "
                             f"the per-head segments {list(segments)} it splits at: keep this projection "
                             f"unquantised or quantise it with another layout")
        if qkvz:
            return split_qkvz(tensor, self.num_k_heads, self.k_dim // pack, self.group_v // pack)
        return split_ba(tensor, self.num_k_heads)

    def _part_rows(self, qkvz: bool) -> tuple[int, int]:
        """Rows of (in_proj_qkv, in_proj_z) or (in_proj_b, in_proj_a)."""
        if qkvz:
            return 2 * self.num_k_heads * self.k_dim + self.num_k_heads * self.group_v, self.num_k_heads * self.group_v
        return self.num_v_heads, self.num_v_heads
