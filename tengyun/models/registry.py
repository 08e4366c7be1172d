"""Architecture name (config.json "architectures") -> model class."""

from __future__ import annotations

import importlib
from typing import Any

_MODELS = {
    "LlamaForCausalLM": ("tengyun.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("tengyun.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("tengyun.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("tengyun.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen3_5ForCausalLM": ("tengyun.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("tengyun.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("tengyun.models.qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("tengyun.models.qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("tengyun.models.qwen3_next", "Qwen3NextForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str):
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture!r} (config.json \"architectures\") is not supported; "
            f"supported: {', '.join(supported_architectures())}."
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)


def model_class_for(config: Any) -> type:
    """The model class an EngineConfig runs: its architecture's, or (--runner pooling) that family's
    *ForCausalLM turned into a pooling model (tengyun/models/pooling_adapters.py)."""
    if config.pooling is None:
        return get_model_class(config.architecture)
    from tengyun.models.pooling_adapters import classifier_token_ids, pooling_model_class
    from tengyun.pooling_config import base_architecture
    from tengyun.tokenizer import get_tokenizer

    base = get_model_class(base_architecture(config.architecture))
    tokens = config.pooling.classifier_from_token
    token_ids = classifier_token_ids(get_tokenizer(config), tokens) if tokens else None
    return pooling_model_class(base, config.pooling, token_ids)
