"""Write a stream of tensors as an HF safetensors checkpoint, holding one shard at a time.

    save_shards(((name, tensor) for ...), folder, max_shard_bytes=1 << 30)
 -> folder/model.safetensors                                  when everything fits in one shard
 -> folder/model-00001-of-00003.safetensors ... + model.safetensors.index.json   otherwise

The index is HF's ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}), so
transformers, vLLM and Tengyun's loader (loader.safetensors_files) read the folder as any sharded
checkpoint. A tensor larger than max_shard_bytes gets a shard of its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from tengyun.models.loader import INDEX_FILE

SINGLE_FILE = "model.safetensors"


def save_shards(tensors: Iterable[tuple[str, torch.Tensor]], folder: Path, max_shard_bytes: int = 1 << 30) -> list[str]:
    """Write ``tensors`` into ``folder`` (see the module docstring) -> their names, in order.
    Memory: the tensors of one shard (at most max_shard_bytes, or one larger tensor)."""
    from safetensors.torch import save_file

    shard: dict[str, torch.Tensor] = {}
    names: list[str] = []
    written: list[tuple[Path, list[str], int]] = []  # (temporary file, its tensor names, their bytes)

    def flush() -> None:
        path = folder / f".shard-{len(written):05d}.safetensors"
        save_file(shard, str(path), {"format": "pt"})
        written.append((path, list(shard), sum(t.numel() * t.element_size() for t in shard.values())))
        shard.clear()

    shard_bytes = 0
    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
            shard_bytes = 0
        shard[name] = tensor.contiguous()
        shard_bytes += size
        names.append(name)
    if shard or not written:
        flush()
    _name_shards(folder, written)
    return names


def _name_shards(folder: Path, written: list[tuple[Path, list[str], int]]) -> None:
    """Rename the temporary shards to HF's names; more than one: write the index too (total_size:
    the tensors' bytes, as transformers counts them)."""
    if len(written) == 1:
        written[0][0].rename(folder / SINGLE_FILE)
        return
    weight_map = {}
    for i, (path, names, _) in enumerate(written):
        final = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        path.rename(folder / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": sum(size for _, _, size in written)}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
