"""Qwen3.5 text model: Gated DeltaNet (linear attention) layers and gated full-attention layers,
as config.json's ``layer_types`` lists them (three "linear_attention" then one "full_attention").

Full attention: q_proj yields per head [query D | gate D]; q/k RMSNorm per head; partial RoPE
(``partial_rotary_factor`` of head_dim, neox halves; text-only positions make Qwen3.5's mrope
this); output attn * sigmoid(gate) before o_proj. Every RMSNorm outside the Gated DeltaNet is
zero-centred (x_norm * (1 + w)). Loads the text-only layout (``model.layers...``) and the
multimodal one (``model.language_model.layers...``); vision (``model.visual.*``) and MTP (``mtp.*``)
tensors are skipped, with one log line each saying how many.
"""

from __future__ import annotations

import torch
from torch import nn

from tengyun.layers.attention.layer import Attention
from tengyun.layers.gated_delta_net import GatedDeltaNet
from tengyun.layers.layernorm import ZeroCenteredRMSNorm
from tengyun.layers.linear import QKVParallelLinear, RowParallelLinear
from tengyun.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from tengyun.model_spec import UNLOADED_CHECKPOINT_PREFIXES, ModelSpec, text_model_name
from tengyun.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen3_5Attention(nn.Module):
    def __init__(self, spec: ModelSpec, max_position: int, dtype: torch.dtype):
        super().__init__()
        hidden, num_heads, self.head_dim = spec.hidden_size, spec.num_attention_heads, spec.head_dim
        # The q shard holds 2 * heads "heads": per head its query then its gate.
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, 2 * num_heads, spec.num_kv_heads, spec.qkv_bias,
                                          dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, spec.o_bias, dtype)
        rope = rope_parameters(spec.hf)
        partial = rope.get("partial_rotary_factor", spec.hf.get("partial_rotary_factor", 1.0))
        self.rotary_emb = RotaryEmbedding(self.head_dim, int(self.head_dim * partial), max_position, rope)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, spec.rms_norm_eps, dtype)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, spec.rms_norm_eps, dtype)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        d, num_tokens = self.head_dim, x.shape[0]
        q_gate, k, v = self.qkv_proj(x).split(
            [2 * self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, gate = q_gate.view(num_tokens, self.num_heads, 2 * d).chunk(2, dim=-1)  # [T, H, D] each
        q = self.q_norm(q).reshape(num_tokens, -1)
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, d)).reshape(num_tokens, -1)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v) * torch.sigmoid(gate.reshape(num_tokens, -1))
        return self.o_proj(out)


class Qwen3_5DecoderLayer(LlamaDecoderLayer):
    """Llama's block with zero-centred norms; the mixer is Gated DeltaNet or gated attention, as
    the layer's type says."""

    norm_cls = ZeroCenteredRMSNorm

    def __init__(self, spec: ModelSpec, layer_idx: int, max_position: int, dtype: torch.dtype, mlp: nn.Module):
        nn.Module.__init__(self)
        self.is_linear = not spec.layer_is_attention(layer_idx)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(spec, dtype)
        else:
            self.self_attn = Qwen3_5Attention(spec, max_position, dtype)
        self.mlp = mlp
        self.input_layernorm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.post_attention_layernorm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps, dtype)

    def mix(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear_attn(hidden) if self.is_linear else self.self_attn(positions, hidden)


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """Also Qwen3_5ForConditionalGeneration: the text model of the multimodal checkpoint."""

    norm_cls = ZeroCenteredRMSNorm

    # Checkpoint tensors not loaded (prefix -> why): vision tower, MTP layers; the loader logs how many of each.
    skipped_checkpoint_prefixes = UNLOADED_CHECKPOINT_PREFIXES

    def layer_factory(self, spec: ModelSpec, max_position: int, dtype: torch.dtype):
        return lambda i: Qwen3_5DecoderLayer(spec, i, max_position, dtype, self.make_mlp(spec, i, dtype))

    # 'model.language_model.layers.0.mlp.up_proj.weight' -> 'model.layers.0.mlp.up_proj.weight'
    # (the multimodal wrapper's text model); other names as they are.
    checkpoint_rename = staticmethod(text_model_name)
