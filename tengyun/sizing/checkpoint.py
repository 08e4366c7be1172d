"""What `tengyun plan` reads of a model folder without loading it: config.json, the checkpoint's
tensor bytes from the safetensors headers, and its quantisation as the engine detects it."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from tengyun.model_spec import UNLOADED_CHECKPOINT_PREFIXES
from tengyun.quantization.config import QuantConfig, detect_quantization


def read_model(path: str | Path) -> tuple[dict[str, Any], int | None, str]:
    """MODEL (a HF folder, or a config.json alone) -> (config, checkpoint bytes or None, name).
    Checkpoint bytes are those of the tensors the engine loads, from the *.safetensors headers
    (a vision tower and MTP layers, UNLOADED_CHECKPOINT_PREFIXES, left out); without the shards,
    model.safetensors.index.json's total_size (all tensors); None when only config.json is there."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: MODEL must be a Hugging Face folder with config.json, "
                                f"or a config.json file.")
    cfg = json.loads(config_path.read_text())
    folder = config_path.parent
    name = folder.name if config_path.name == "config.json" else config_path.stem
    index = folder / "model.safetensors.index.json"
    index_json = json.loads(index.read_text()) if index.is_file() else None
    shards = ([folder / f for f in sorted(set(index_json.get("weight_map", {}).values()))] if index_json
              else sorted(folder.glob("*.safetensors")))
    if shards and all(s.is_file() for s in shards):
        return cfg, sum(safetensors_bytes(s, tuple(UNLOADED_CHECKPOINT_PREFIXES)) for s in shards), name
    total = (index_json or {}).get("metadata", {}).get("total_size")
    return cfg, (int(total) if total else None), name


def read_quantization(path: str | Path, hf_config: dict[str, Any], forced: str | None = None) -> QuantConfig | None:
    """The checkpoint's quantisation as the engine reads it (config.json, --quantization ``forced``)."""
    path = Path(path)
    return detect_quantization(hf_config, forced, path if path.is_dir() else path.parent)


def safetensors_bytes(path: Path, skip: tuple[str, ...] = ()) -> int:
    """Tensor bytes in a .safetensors file, from its JSON header (8-byte length, then JSON), less
    the tensors whose names start with one of ``skip``."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(end - start for key, meta in header.items() if key != "__metadata__" and not key.startswith(skip)
               for start, end in [meta["data_offsets"]])
