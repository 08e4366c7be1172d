"""Qwen3.5's multi-token-prediction head (checkpoint tensors ``mtp.*``, config.json
``mtp_num_hidden_layers``), the draft model of ``--speculative-config '{"method": "mtp", ...}'``;
Qwen3-Next's is the same (same names; ``num_nextn_predict_layers``, or counted from the
checkpoint), with Qwen3-Next's MLP (``target.make_mlp``: MoE on the releases).

At position p it reads the next token t_{p+1} and the target's final hidden state h_p and
predicts t_{p+2}, sharing the target's embedding and LM head:

    x = fc([pre_fc_norm_embedding(embed(t_{p+1})) | pre_fc_norm_hidden(h_p)])    # [T, 2H] -> [T, H]
    x = layers[step % mtp_num_hidden_layers](x)     # a full-attention Qwen3.5 decoder layer
    out = norm(x)                                   # logits = the target's lm_head(out)

Draft step j > 0 feeds its previous output ``out`` as the hidden state, at the next position.
Every norm is zero-centred, as elsewhere in Qwen3.5. The layers keep their own paged KV cache,
bound by tengyun/worker/mtp_proposer.py.

Parallelism: the head lives on the last pipeline stage, beside the LM head; its layer's linears
split over TP ranks as the target's do (``fc`` is replicated). A last stage that is not also the
first has no embedding to share, so the head loads its own copy of the target's
(``model.embed_tokens.weight``), as vLLM's MTP model does.
"""

from __future__ import annotations

import torch
from torch import nn

from tengyun.layers.embed_head import VocabParallelEmbedding
from tengyun.layers.layernorm import ZeroCenteredRMSNorm
from tengyun.layers.linear import ReplicatedLinear
from tengyun.model_spec import ModelSpec
from tengyun.models.pipeline import PPMissingLayer
from tengyun.models.qwen3_5 import Qwen3_5Attention, Qwen3_5DecoderLayer

MTP_PREFIX = "mtp."
_TARGET_EMBED = "model.embed_tokens.weight"


class Qwen3_5MtpLayer(Qwen3_5DecoderLayer):
    """A Qwen3.5 decoder layer that is always full attention (the MTP layers are)."""

    def __init__(self, spec: ModelSpec, max_position: int, dtype: torch.dtype, mlp: nn.Module):
        nn.Module.__init__(self)
        self.is_linear = False
        self.self_attn = Qwen3_5Attention(spec, max_position, dtype)
        self.mlp = mlp
        self.input_layernorm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.post_attention_layernorm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps, dtype)


class Qwen3_5MultiTokenPredictor(nn.Module):
    def __init__(self, spec: ModelSpec, max_position: int, dtype: torch.dtype, target: nn.Module):
        super().__init__()
        hidden = spec.hidden_size
        # The target's checkpoint mapping (fused q/k/v, gate/up, MoE experts, layouts it splits)
        # applies to mtp.* too.
        self.packed_modules_mapping = target.packed_modules_mapping
        for hook in ("checkpoint_name_to_param", "checkpoint_transform"):
            if getattr(target, hook, None) is not None:
                setattr(self, hook, getattr(target, hook))
        self.fc = ReplicatedLinear(2 * hidden, hidden, False, dtype)
        # vLLM numbers the MTP layers after the target's (layer index num_hidden_layers + i).
        self.layers = nn.ModuleList(
            Qwen3_5MtpLayer(spec, max_position, dtype, target.make_mlp(spec, spec.num_layers + i, dtype))
            for i in range(spec.mtp_num_layers))
        self.norm = ZeroCenteredRMSNorm(hidden, spec.rms_norm_eps, dtype)
        # The target's embedding where this stage holds it (not a submodule: the target loads it),
        # else the head's own copy.
        self.own_embedding = isinstance(target.model.embed_tokens, PPMissingLayer)
        if self.own_embedding:
            self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, hidden, dtype)
        else:
            self._shared_embedding = [target.model.embed_tokens]
        self._target_rename = getattr(target, "checkpoint_rename", None) or (lambda name: name)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden, spec.rms_norm_eps, dtype)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, spec.rms_norm_eps, dtype)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [T] -> [T, H], with the target's embedding (or this stage's copy of it)."""
        return self.embed_tokens(token_ids) if self.own_embedding else self._shared_embedding[0](token_ids)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                step: int = 0) -> torch.Tensor:
        """embeds [T, H] of t_{p+1}, hidden [T, H] (h_p, or the previous step's output), positions
        [T] (p) -> [T, H]: normed output, for the target's LM head and the next draft step."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x, residual = self.layers[step % len(self.layers)](positions, x, None)
        out, _ = self.norm(x, residual)
        return out

    def checkpoint_rename(self, name: str) -> str | None:
        """'mtp.layers.0.self_attn.q_proj.weight' -> 'layers.0.self_attn.q_proj.weight'; the
        target's embedding -> 'embed_tokens.weight' where the head keeps its own copy; the
        target's other tensors -> None (loaded by the target)."""
        if name.startswith(MTP_PREFIX):
            return name[len(MTP_PREFIX):]
        if self.own_embedding and self._target_rename(name) == _TARGET_EMBED:
            return "embed_tokens.weight"
        return None
