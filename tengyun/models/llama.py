"""LlamaForCausalLM, also the base of Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm).

HF parameter names are kept, except that q/k/v and gate/up are packed
(``packed_modules_mapping``); every layer loads its own shard of each checkpoint tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from tengyun.distributed.parallel_state import is_first_pp_rank, is_last_pp_rank
from tengyun.layers.activation import SiluAndMul
from tengyun.layers.attention.layer import Attention
from tengyun.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from tengyun.layers.layernorm import RMSNorm
from tengyun.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tengyun.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from tengyun.model_spec import ModelSpec
from tengyun.models.pipeline import IntermediateTensors, PPMissingLayer, make_layers


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, dtype)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, max_position: int, dtype: torch.dtype):
        super().__init__()
        hidden, num_heads, self.head_dim = spec.hidden_size, spec.num_attention_heads, spec.head_dim
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, spec.num_kv_heads, spec.qkv_bias, dtype)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, spec.o_bias, dtype)
        self.q_size = self.qkv_proj.num_heads * self.head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * self.head_dim
        rotary_dim = int(self.head_dim * spec.hf.get("partial_rotary_factor", 1.0))
        self.rotary_emb = RotaryEmbedding(self.head_dim, rotary_dim, max_position, rope_parameters(spec.hf))
        self.qk_norm = spec.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, dtype)
        self.attn = Attention(self.qkv_proj.num_heads, self.head_dim, self.qkv_proj.num_kv_heads,
                              self.head_dim ** -0.5)
        # Attention.from_qkv computes HF's arithmetic only without q/k norms and with every channel
        # rotated.
        self.fuses_qkv = not self.qk_norm and rotary_dim == self.head_dim

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # x [T, hidden] -> qkv [T, (Hq + 2 Hkv) * D]
        qkv = self.qkv_proj(x)
        if self.fuses_qkv:  # on a backend that takes qkv whole (cpu_paged)
            out = self.attn.from_qkv(qkv, positions, self.rotary_emb.cos, self.rotary_emb.sin)
            if out is not None:
                return self.o_proj(out)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


def make_dense_mlp(spec: ModelSpec, layer_idx: int, dtype: torch.dtype) -> nn.Module:
    return LlamaMLP(spec.hidden_size, spec.intermediate_size, dtype, spec.hf.get("mlp_bias", False))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: norm -> token mixer (``mix``: attention here) -> norm -> MLP."""

    norm_cls = RMSNorm

    def __init__(self, spec: ModelSpec, max_position: int, dtype: torch.dtype, mlp: nn.Module):
        super().__init__()
        self.self_attn = LlamaAttention(spec, max_position, dtype)
        self.mlp = mlp
        self.input_layernorm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.post_attention_layernorm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps, dtype)

    def mix(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The token mixer: hidden [T, H] -> [T, H]."""
        return self.self_attn(positions, hidden)

    def forward(self, positions, hidden, residual):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.mix(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """One pipeline stage of the decoder: embedding on the first, final norm on the last.

    ``make_layer(index)`` builds decoder layer ``index``; every layer takes and returns
    (hidden, residual). Shared by every model family here (Qwen3.5 passes its own layers/norm).
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, make_layer, norm_cls=RMSNorm):
        super().__init__()
        hidden = spec.hidden_size
        self.embed_tokens = (VocabParallelEmbedding(spec.vocab_size, hidden, dtype)
                             if is_first_pp_rank() else PPMissingLayer())
        self.start_layer, self.end_layer, self.layers = make_layers(spec, make_layer)
        self.norm = norm_cls(hidden, spec.rms_norm_eps, dtype) if is_last_pp_rank() else PPMissingLayer()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: IntermediateTensors | None = None, *,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        """Last stage: hidden states [T, hidden]; earlier stages: [hidden, residual] for the next.
        inputs_embeds [T, hidden] (first stage): used instead of embedding input_ids."""
        if intermediate is None:
            hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            hidden, residual = intermediate
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden, residual = layer(positions, hidden, residual)
        if not is_last_pp_rank():
            return [hidden, residual]
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    make_mlp = staticmethod(make_dense_mlp)  # (spec, layer_idx, dtype) -> the layer's MLP
    norm_cls = RMSNorm

    def __init__(self, spec: ModelSpec, max_position: int, dtype: torch.dtype):
        super().__init__()
        self.model = LlamaModel(spec, dtype, self.layer_factory(spec, max_position, dtype), self.norm_cls)
        self.tie_word_embeddings = spec.tie_word_embeddings
        if is_last_pp_rank():
            self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, dtype)
            if self.tie_word_embeddings and is_first_pp_rank():
                self.lm_head.tie_to(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()

    def layer_factory(self, spec: ModelSpec, max_position: int, dtype: torch.dtype):
        """index -> decoder layer ``index`` of this family."""
        return lambda i: LlamaDecoderLayer(spec, max_position, dtype, self.make_mlp(spec, i, dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: IntermediateTensors | None = None, *,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions [T] -> hidden states [T, hidden] (or [hidden, residual] before the last
        stage); inputs_embeds [T, hidden] (prompt embeddings): the first stage's input instead of input_ids."""
        return self.model(input_ids, positions, intermediate, inputs_embeds=inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> their embeddings [T, hidden] (first stage; a collective under TP)."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] -> logits [N, vocab] in the head's dtype on TP rank 0 (the sampler and
        the logprobs widen them to float32 where they compute; the CPU's compiled draw reads bfloat16
        as it is); None on the other TP ranks."""
        return self.lm_head.compute_logits(hidden)
