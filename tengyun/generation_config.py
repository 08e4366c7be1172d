"""--generation-config: the model's generation_config.json as the default sampling parameters,
as vLLM applies it. Pure functions over files: no torch, no engine.

    --generation-config auto    the model folder's generation_config.json (none there: no defaults)
    --generation-config vllm    no defaults: SamplingParams' own (temperature 1, max_tokens 16, ...)
    --generation-config DIR     DIR/generation_config.json

A request's own values win; only the fields it leaves unset take these defaults.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json field -> SamplingParams field; everything else (do_sample, eos_token_id, ...) is ignored.
SAMPLING_FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
                   "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}
# transformers' GenerationConfig defaults: a file value equal to one is not a default of the model
# (vLLM reads the file through GenerationConfig.to_diff_dict(), which drops them too).
HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}


def generation_config_file(generation_config: str, model_path: Path | None) -> Path | None:
    """The file --generation-config points at; None for "vllm"."""
    if generation_config == "vllm":
        return None
    folder = model_path if generation_config == "auto" else Path(generation_config).expanduser()
    return None if folder is None else folder / GENERATION_CONFIG_FILE


def read_sampling_defaults(path: Path | None) -> dict[str, Any]:
    """{"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 512, ...}
    -> {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 512}.
    A missing file (a GGUF-converted folder has none) means no defaults; null values and values
    equal to transformers' own defaults (top_k 50, temperature 1.0, ...) are skipped."""
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON ({e}): fix it or pass --generation-config vllm.") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object: fix it or pass --generation-config vllm.")
    defaults = {ours: data[theirs] for theirs, ours in SAMPLING_FIELDS.items()
                if data.get(theirs) is not None and data[theirs] != HF_DEFAULTS.get(theirs)}
    _check(defaults, path)
    return defaults


def _check(defaults: dict[str, Any], path: Path) -> None:
    """Bad values fail at start, naming the file, not in every request that leaves them unset."""
    from tengyun.sampling_params import SamplingParams

    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e} Fix the file or pass --generation-config vllm.") from None


def sampling_defaults(config: Any) -> dict[str, Any]:
    """The defaults for a finalized EngineConfig, logged once when there are any."""
    path = generation_config_file(config.generation_config, config.model_path)
    defaults = read_sampling_defaults(path)
    if defaults:
        logger.info("Default sampling parameters have been overridden by the model's generation config %s: %s. "
                    "Requests that set a field keep their own value; pass --generation-config vllm to drop these "
                    "defaults.", path, ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults
