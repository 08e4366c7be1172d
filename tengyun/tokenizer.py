"""Tokenizer loading (transformers' fast tokenizers) and the model's EOS ids."""

from __future__ import annotations

import importlib
import json
import logging
from typing import Any

from tengyun.tokenizer_classes import record_class, recorded_class
from tengyun.config import EngineConfig

logger = logging.getLogger(__name__)


def class_path(tokenizer: Any) -> str | None:
    """"module:class" of a loaded tokenizer (what get_tokenizer's ``same_class_as`` takes)."""
    return None if tokenizer is None else f"{type(tokenizer).__module__}:{type(tokenizer).__qualname__}"


def get_tokenizer(config: EngineConfig, same_class_as: str | None = None) -> Any:
    """AutoTokenizer's tokenizer for the model. ``same_class_as``: the class AutoTokenizer picked
    in the engine process (class_path); the API process loads that class directly, which gives the
    same tokenizer without importing torch (AutoTokenizer imports transformers' configuration
    module, which imports torch: ~180 MiB the front end does not need). Without it, the class
    AutoTokenizer chose for this folder at an earlier start (tokenizer_classes), loaded directly
    too. Remote code, a class outside transformers or any failure: AutoTokenizer, whose choice is
    then recorded. None with --skip-tokenizer-init."""
    if getattr(config, "skip_tokenizer_init", False):
        return None
    if not config.trust_remote_code:
        chosen = same_class_as or recorded_class(config.tokenizer_path)
        tokenizer = _load_class(chosen, config) if chosen else None
        if tokenizer is not None:
            return tokenizer
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(config.tokenizer_path),
                                                  trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"Could not load a tokenizer from {config.tokenizer_path}: {e}. Pass --tokenizer with a "
            f"folder holding tokenizer.json (or tokenizer.model / vocab.json + merges.txt)."
        ) from e
    if not config.trust_remote_code:
        record_class(config.tokenizer_path, class_path(tokenizer))
    return tokenizer


def preload_tokenizer(config: EngineConfig) -> tuple[str, Any] | None:
    """What the API process does in a thread while the engine process loads (it is idle then):
    import transformers' fast-tokenizer side (~0.6-1 s, no torch) and load the class recorded for
    this folder at an earlier start (Qwen2.5's tokenizer: 0.4-1 s on 2 cores). Returns (class_path,
    tokenizer) for the server to use once the engine names the same class, or None: no record,
    remote code, --skip-tokenizer-init, or a failure, which get_tokenizer then meets and reports.
    Never AutoTokenizer: that imports torch, which the API process does not need."""
    if getattr(config, "skip_tokenizer_init", False):
        return None
    try:
        from transformers import PreTrainedTokenizerFast  # noqa: F401 - loads the tokenizers library too
    except ImportError:
        return None
    chosen = None if config.trust_remote_code else recorded_class(config.tokenizer_path)
    tokenizer = _load_class(chosen, config) if chosen else None
    return None if tokenizer is None else (chosen, tokenizer)


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
    """The tokenizer's EOS plus generation_config.json's eos_token_id (int or list); without a
    tokenizer (--skip-tokenizer-init) config.json's eos_token_id stands in for the tokenizer's."""
    ids: set[int] = set()
    if tokenizer is None:
        ids.update(_eos_ids(config.model_path / "config.json"))
    elif tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids | _eos_ids(config.model_path / "generation_config.json")


def _eos_ids(path) -> set[int]:
    """A JSON file's eos_token_id (int or list) as a set; empty when the file or the key is missing."""
    value = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value} if isinstance(value, list) else set()
