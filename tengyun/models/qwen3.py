"""Qwen3ForCausalLM: Llama with RMSNorm over each head of q and k before RoPE (no qkv bias)."""

from __future__ import annotations

from tengyun.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
