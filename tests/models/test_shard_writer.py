"""save_shards: a stream of tensors written as HF's safetensors layout, one shard held at a time."""

import json
import shutil

import torch
from safetensors.torch import load_file

from tengyun.models.loader import INDEX_FILE, safetensors_files
from tengyun.models.shard_writer import save_shards


def _tensors(folder) -> dict[str, torch.Tensor]:
    merged = {}
    for path in safetensors_files(folder):
        merged.update(load_file(path))
    return merged


def test_tensors_past_the_shard_size_go_in_shards_that_transformers_loads(tiny_checkpoints, tmp_path):
    """A tiny Llama's weights in shards of at most 64 KiB (a larger tensor alone in one): HF
    names, an index whose total_size is the tensors' bytes, and transformers' own
    from_pretrained reads the folder back to the same state dict."""
    from transformers import AutoModelForCausalLM

    source = tiny_checkpoints["llama"]
    original = load_file(source / "model.safetensors")
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(source / "config.json", out)
    names = save_shards(iter(original.items()), out, max_shard_bytes=64 << 10)
    assert names == list(original)
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(files) and index["weight_map"].keys() == original.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    for name in files:  # each shard within the limit, unless it holds one larger tensor
        shard = load_file(out / name)
        assert len(shard) == 1 or sum(t.numel() * t.element_size() for t in shard.values()) <= 64 << 10
    assert not list(out.glob(".shard-*"))
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in original.items())


def test_what_fits_in_one_shard_is_model_safetensors(tmp_path):
    tensors = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    assert save_shards(iter(tensors.items()), tmp_path) == ["a", "b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert all(torch.equal(_tensors(tmp_path)[k], v) for k, v in tensors.items())
