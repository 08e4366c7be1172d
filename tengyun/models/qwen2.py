"""Qwen2ForCausalLM (Qwen2, Qwen2.5): Llama with a bias on q/k/v; LM head tied or not."""

from __future__ import annotations

from tengyun.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
