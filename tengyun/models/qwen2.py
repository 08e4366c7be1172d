"""Qwen2ForCausalLM (Qwen2, Qwen2.5): Llama with a bias on q/k/v (ModelSpec.qkv_bias); LM head tied or not."""

from __future__ import annotations

from tengyun.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """The attention variant comes from config.json's model_type through the ModelSpec."""
