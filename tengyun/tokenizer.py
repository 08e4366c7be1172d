"""Tokenizer loading (transformers' fast tokenizers) and the model's EOS ids."""

from __future__ import annotations

import json
from typing import Any

from tengyun.config import EngineConfig


def get_tokenizer(config: EngineConfig) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(config.tokenizer_path), trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"Could not load a tokenizer from {config.tokenizer_path}: {e}. Pass --tokenizer with a "
            f"folder holding tokenizer.json (or tokenizer.model / vocab.json + merges.txt)."
        ) from e


def eos_token_ids(config: EngineConfig, tokenizer: Any) -> set[int]:
    """The tokenizer's EOS plus generation_config.json's eos_token_id (int or list)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_config = config.model_path / "generation_config.json"
    if generation_config.exists():
        value = json.loads(generation_config.read_text()).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return ids
