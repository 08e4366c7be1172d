"""Tokenizer loading (transformers' fast tokenizers) and the model's EOS ids."""

from __future__ import annotations

import importlib
import json
import logging
from typing import Any

from tengyun.config import EngineConfig

logger = logging.getLogger(__name__)


def class_path(tokenizer: Any) -> str | None:
    """"module:class" of a loaded tokenizer (what get_tokenizer's ``same_class_as`` takes)."""
    return None if tokenizer is None else f"{type(tokenizer).__module__}:{type(tokenizer).__qualname__}"


def get_tokenizer(config: EngineConfig, same_class_as: str | None = None) -> Any:
    """AutoTokenizer's tokenizer for the model. ``same_class_as``: the class AutoTokenizer picked
    in the engine process (class_path); the API process loads that class directly, which gives the
    same tokenizer without importing torch (AutoTokenizer imports transformers' configuration
    module, which imports torch: ~180 MiB the front end does not need). Remote code, a class
    outside transformers or any failure: AutoTokenizer."""
    if same_class_as and not config.trust_remote_code:
        tokenizer = _load_class(same_class_as, config)
        if tokenizer is not None:
            return tokenizer
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(config.tokenizer_path), trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"Could not load a tokenizer from {config.tokenizer_path}: {e}. Pass --tokenizer with a "
            f"folder holding tokenizer.json (or tokenizer.model / vocab.json + merges.txt)."
        ) from e


def _load_class(path: str, config: EngineConfig) -> Any:
    module, _, name = path.partition(":")
    if not module.startswith("transformers."):
        return None
    try:
        return getattr(importlib.import_module(module), name).from_pretrained(str(config.tokenizer_path))
    except Exception as e:  # noqa: BLE001 - AutoTokenizer then says what is wrong
        logger.debug("Loading the tokenizer as %s failed (%s); using AutoTokenizer", path, e)
        return None


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
