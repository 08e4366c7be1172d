"""Qwen3ForCausalLM: Llama with RMSNorm over each head of q and k before RoPE (ModelSpec.qk_norm;
no qkv bias)."""

from __future__ import annotations

from tengyun.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """The attention variant comes from config.json's model_type through the ModelSpec."""
