"""Fill a model's parameters from safetensors files (HF names), or with seeded random values.

Checkpoint names map onto parameters through the model's `packed_modules_mapping`:
    model.layers.0.self_attn.k_proj.weight -> model.layers.0.self_attn.qkv_proj.weight, shard "k"
    model.layers.0.mlp.up_proj.bias        -> model.layers.0.mlp.gate_up_proj.bias,     shard 1
    model.layers.0.self_attn.v_proj.qweight -> ...self_attn.qkv_proj.shards.2.qweight, shard "v"
                                              (a fused layer holding its modules in different schemes)
every other name is kept as is. A model may also rename checkpoint tensors (`checkpoint_rename`),
map them itself (`checkpoint_name_to_param`), split one into several (`checkpoint_transform`), or
leave whole kinds unread (`skipped_checkpoint_prefixes`: prefix -> why, one log line each).
FP8 block-quantized weights are dequantized as they are read (fp8_block.py), before all of that.
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from tengyun.layers.weight_loading import WeightFormatError, WeightShapeError, default_weight_loader
from tengyun.models import fp8_block as fp8
from tengyun.models.pipeline import missing_prefixes

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_QKV_SHARDS = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed by the rotary layer
_EMBED = "model.embed_tokens.weight"
# A tied head's tensors: the embedding's, dense or a GGUF's blocks (layers/embed_head.py)
_EMBED_TENSORS = {f"model.embed_tokens.{t}": f"lm_head.{t}" for t in ("weight", "qweight")}


@dataclass(frozen=True)
class _Target:
    param_name: str
    shard_id: str | int | None  # None: not a packed parameter
    part: int = 0  # which of checkpoint_transform's outputs (0: the tensor itself)


def load_weights(model: torch.nn.Module, folder: Path, load_format: str, seed: int = 0,
                 fp8_block: tuple[int, int] | None = None) -> None:
    """Copy every checkpoint tensor in `folder` into its parameter, or fill with random values ("dummy").
    ``fp8_block``: the tile of an FP8 block-quantized checkpoint (ModelSpec.fp8_block), whose float8
    weights are dequantized with their ``*_scale_inv`` tensors as they are read."""
    if load_format == "dummy":
        _fill_dummy(model, seed)  # `folder` is not read
    elif load_format in ("safetensors", "auto"):
        _load_safetensors(model, Path(folder), fp8_block)
    else:
        raise ValueError(f"--load-format {load_format!r} cannot load weights; use 'safetensors' or 'dummy'")


def safetensors_files(folder: Path) -> list[Path]:
    """The shards named by model.safetensors.index.json, else every *.safetensors in `folder`."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"shard {f.name} named in {index} is missing from {folder}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}; pass --load-format dummy for random weights")
    return files


def _is_tied(model: torch.nn.Module, params: dict[str, torch.nn.Parameter]) -> bool:
    if getattr(model, "tie_word_embeddings", False):
        return True
    head, embed = params.get("lm_head.weight"), params.get(_EMBED)
    return head is not None and head is embed


def _shard_id(packed_name: str, index: int, shard_name: str) -> str | int:
    # qkv_proj: "q" / "k" / "v"; every other packed parameter: the shard's index (gate 0, up 1)
    return _QKV_SHARDS.get(shard_name, index) if packed_name == "qkv_proj" else index


def _map_name(name: str, params: dict, packed: dict[str, list[str]], custom=None) -> _Target | None:
    """Checkpoint name -> parameter (and shard); None when the model has no such parameter.

    ``custom`` is the model's own ``checkpoint_name_to_param(name) -> (param, shard) | None``
    (e.g. per-expert MoE tensors into stacked expert weights), tried first."""
    mapped = custom(name) if custom else None
    if mapped is not None and mapped[0] in params:
        return _Target(*mapped)
    for packed_name, shard_names in packed.items():
        for i, shard_name in enumerate(shard_names):
            if f".{shard_name}." in name:
                for fused in (f".{packed_name}.", f".{packed_name}.shards.{i}."):  # the layer, or its LinearShard
                    param_name = name.replace(f".{shard_name}.", fused)
                    if param_name in params:
                        return _Target(param_name, _shard_id(packed_name, i, shard_name))
    return _Target(name, None) if name in params else None


def _quantised_layer(name: str, params: dict, packed: dict[str, list[str]], custom=None) -> bool:
    """Is ``name`` (as the model calls it) a dense ``.weight`` of a layer that holds quantised tensors?"""
    module = name.removesuffix(".weight")
    return module != name and any(_map_name(f"{module}.{tensor}", params, packed, custom) is not None
                                  for tensor in ("qweight", "weight_packed", "weight_scale", "scales"))


def _parts(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The model's ``checkpoint_transform(name, tensor) -> [(name, tensor), ...] | None``, which splits
    one checkpoint tensor into several (Qwen3-Next: in_proj_qkvz -> in_proj_qkv, in_proj_z); None or
    no such method: [(name, tensor)]. Planning calls it with a meta tensor of the stored shape."""
    transform = getattr(model, "checkpoint_transform", None)
    return (transform(name, tensor) if transform else None) or [(name, tensor)]


@dataclass(frozen=True)
class _Stored:
    file: Path
    dtype: str  # safetensors' name: "F32", "BF16", "F8_E4M3", ...
    shape: tuple[int, ...]


def _stored_tensors(files: list[Path]) -> dict[str, _Stored]:
    """Every checkpoint tensor, from the safetensors headers, in file then header order."""
    stored = {}
    for f in files:
        with safe_open(f, framework="pt") as reader:
            for name in reader.keys():
                info = reader.get_slice(name)
                stored[name] = _Stored(f, info.get_dtype(), tuple(info.get_shape()))
    return stored


def _fp8_scales(stored: dict[str, _Stored], block: tuple[int, int] | None, folder: Path) -> dict[str, str]:
    """Weight name -> the name of its FP8 block scales (fp8.scale_name); checks that every
    float8 weight has its scales and that config.json declares the block quantization."""
    scales = {fp8.weight_of_scale(n): n for n in stored if fp8.is_scale(n)}
    orphans = [n for w, n in scales.items() if w not in stored]
    if orphans:
        raise ValueError(f"{len(orphans)} FP8 scale tensor(s) in {folder} have no weight beside them, e.g. "
                         f"{orphans[:3]}: the checkpoint is incomplete")
    if scales and block is None:
        raise ValueError(f"the checkpoint at {folder} holds FP8 block scales (e.g. {next(iter(scales.values()))}) "
                         f"but config.json's quantization_config is not quant_method 'fp8' with weight_block_size: "
                         f"use the config.json that came with these weights")
    unscaled = [n for n, t in stored.items() if t.dtype in fp8.FP8_DTYPES and n not in scales]
    if unscaled:
        raise ValueError(f"{len(unscaled)} float8 checkpoint tensor(s) in {folder} have no "
                         f"'{fp8.SCALE_SUFFIX}' block scales beside them, e.g. {unscaled[:3]}: Tengyun reads "
                         f"FP8 weights only block-quantized (quant_method fp8 with weight_block_size)")
    return scales


def _skip_prefix(model: torch.nn.Module, name: str) -> str | None:
    """The prefix of ``model.skipped_checkpoint_prefixes`` (prefix -> why) ``name`` starts with, if any."""
    return next((p for p in getattr(model, "skipped_checkpoint_prefixes", {}) if name.startswith(p)), None)


def _log_skipped(model: torch.nn.Module, stored: dict[str, _Stored]) -> None:
    """One line per skipped kind of tensor: how many, and why (e.g. the vision tower)."""
    counts: dict[str, int] = {}
    for name in stored:
        prefix = _skip_prefix(model, name)
        if prefix is not None:
            counts[prefix] = counts.get(prefix, 0) + 1
    for prefix, count in counts.items():
        logger.info("Skipping %d %s* checkpoint tensors: %s", count, prefix, model.skipped_checkpoint_prefixes[prefix])


def _plan(model: torch.nn.Module, stored: dict[str, _Stored], folder: Path) -> list[tuple[Path, str, _Target]]:
    """(file, checkpoint name, target) for every tensor to load; raises on unknown or missing names.
    FP8 scale tensors are not planned: they are read with their weights."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {})
    tied = _is_tied(model, params)
    other_stages = missing_prefixes(model)  # pipeline parallel: layers another stage loads
    # Last pipeline stage of a tied model: the head has no embedding to share, so it loads the embedding's tensor.
    head_from_embed = (tied and not params.keys() & _EMBED_TENSORS.keys()
                       and bool(params.keys() & set(_EMBED_TENSORS.values())))
    # The model's own renaming (e.g. a multimodal wrapper's prefix off; None: not loaded), else names as is.
    rename = getattr(model, "checkpoint_rename", None) or (lambda n: n)
    custom = getattr(model, "checkpoint_name_to_param", None)
    plan, unexpected = [], []
    for stored_name, info in stored.items():
        if fp8.is_scale(stored_name) or _skip_prefix(model, stored_name) is not None:
            continue
        renamed = rename(stored_name)
        if renamed is None:  # the model's own choice not to load it
            continue
        for part, (name, _) in enumerate(_parts(model, renamed, torch.empty(info.shape, device="meta"))):
            if name.endswith(_SKIPPED_SUFFIXES) or (tied and name in _EMBED_TENSORS.values()):
                continue
            if head_from_embed and name in _EMBED_TENSORS:
                plan.append((info.file, stored_name, _Target(_EMBED_TENSORS[name], None, part)))
                continue
            if name.startswith(other_stages):
                continue
            target = _map_name(name, params, packed, custom)
            if target is not None and not _wanted(params[target.param_name], target.shard_id):
                continue  # another rank's expert: never read
            if target is None:
                shown = stored_name if name == stored_name else f"{stored_name} as {name}"
                unexpected.append((name, f"{shown} ({info.file.name})"))
            else:
                plan.append((info.file, stored_name, _Target(target.param_name, target.shard_id, part)))
    if unexpected:
        dense = [shown for name, shown in unexpected if _quantised_layer(name, params, packed, custom)]
        cause = (f"{len(dense)} of them dense weights of layers config.json's quantization_config quantises (e.g. "
                 f"{dense[0]}): name those modules in its ignore list (compressed-tensors), modules_to_not_convert "
                 f"(AWQ) or dynamic as \"-:<regex>\" (GPTQ)" if dense else
                 "config.json's architecture disagrees with the checkpoint")
        raise ValueError(f"{len(unexpected)} checkpoint tensor(s) in {folder} match no model parameter, e.g. "
                         f"{[shown for _, shown in unexpected[:5]]}; {cause}")
    _check_complete(plan, params, packed, tied and not head_from_embed, folder)
    return plan


def _wanted(param: torch.nn.Parameter, shard_id) -> bool:
    """False for a shard of a stacked parameter this rank does not hold (MoE experts of other ranks:
    the parameter's shard_ids list the ones it holds)."""
    held = getattr(param, "shard_ids", None)
    return shard_id is None or held is None or shard_id in held


def _check_complete(plan: list, params: dict, packed: dict[str, list[str]], head_shared: bool, folder: Path) -> None:
    """Every parameter (every shard of a packed or stacked one) has a planned tensor."""
    expected = {(n, None) for n in params if not (head_shared and n in _EMBED_TENSORS.values())}
    for packed_name, shard_names in packed.items():
        for n in [n for n, _ in expected if f".{packed_name}." in n and not hasattr(params[n], "shard_ids")]:
            expected.discard((n, None))
            expected |= {(n, _shard_id(packed_name, i, s)) for i, s in enumerate(shard_names)}
    for n in [n for n, _ in expected if hasattr(params[n], "shard_ids")]:  # stacked MoE experts, a LinearShard
        expected.discard((n, None))
        expected |= {(n, shard) for shard in params[n].shard_ids}
    missing = sorted(expected - {(t.param_name, t.shard_id) for _, _, t in plan}, key=str)
    if missing:
        shown = [n if s is None else f"{n} (shard {s})" for n, s in missing[:5]]
        raise ValueError(
            f"{len(missing)} model parameter(s) have no tensor in the checkpoint at {folder}, "
            f"e.g. {shown}; config.json disagrees with the checkpoint"
        )


def _read(reader, stored: dict[str, _Stored], name: str, scales: dict[str, str],
          block: tuple[int, int] | None) -> torch.Tensor:
    """Checkpoint tensor ``name`` from the open file ``reader``; an FP8 weight dequantized (float32)
    with its scales, which may sit in another shard."""
    tensor = reader.get_tensor(name)
    if name not in scales:
        return tensor
    scale_file = stored[scales[name]].file
    if scale_file == stored[name].file:
        scale = reader.get_tensor(scales[name])
    else:
        with safe_open(scale_file, framework="pt") as other:
            scale = other.get_tensor(scales[name])
    try:
        return fp8.dequantize(tensor, scale, block)
    except ValueError as e:
        raise ValueError(f"FP8 block scales {scales[name]} in {scale_file} have {e}: config.json's "
                         f"quantization_config weight_block_size disagrees with the checkpoint") from e


def _load_safetensors(model: torch.nn.Module, folder: Path, block: tuple[int, int] | None) -> None:
    start = time.perf_counter()
    files = safetensors_files(folder)
    stored = _stored_tensors(files)
    scales = _fp8_scales(stored, block, folder)
    plan = _plan(model, stored, folder)
    _log_skipped(model, stored)
    params = dict(model.named_parameters(remove_duplicate=False))
    rename = getattr(model, "checkpoint_rename", None) or (lambda n: n)
    show_bar = len(files) > 1 and sys.stderr.isatty()
    with torch.no_grad():
        for f in tqdm(files, desc="Loading safetensors shards", disable=not show_bar):
            with safe_open(f, framework="pt") as reader:
                # A tensor's entries are adjacent in the plan: read (dequantize, transform) it once.
                for name, entries in itertools.groupby((p for p in plan if p[0] == f), key=lambda p: p[1]):
                    renamed = rename(name)
                    parts = _parts(model, renamed, _read(reader, stored, name, scales, block))
                    for _, _, target in entries:
                        part_name, tensor = parts[target.part]
                        shown = name if part_name == renamed else f"{name} (as {part_name})"
                        _load_one(params[target.param_name], tensor, target, shown, f)
    logger.info("loaded %d tensors from %d file(s) in %s in %.1fs%s", len(plan), len(files), folder,
                time.perf_counter() - start, f" ({len(scales)} FP8 weights dequantized)" if scales else "")


def _load_one(param: torch.nn.Parameter, tensor: torch.Tensor, target: _Target, name: str, file: Path) -> None:
    loader = getattr(param, "weight_loader", None)
    if loader is None and target.shard_id is not None:
        raise TypeError(f"packed parameter {target.param_name} has no weight_loader to place shard {target.shard_id}")
    try:
        if target.shard_id is not None:
            loader(param, tensor, target.shard_id)
        else:
            (loader or default_weight_loader)(param, tensor)
    except WeightShapeError as e:
        shard = "" if target.shard_id is None else f" (shard {target.shard_id})"
        scheme = getattr(param, "described_as", None)  # a quantised layer's format (tengyun/layers/linear.py)
        raise ValueError(
            f"checkpoint tensor {name} in {file} has shape {list(e.actual)}, but parameter "
            f"{target.param_name}{shard} built from config.json" + (f" as {scheme}" if scheme else "")
            + f" expects {list(e.expected)}: "
            f"config.json disagrees with the checkpoint; use the config.json that came with these weights"
        ) from e
    except WeightFormatError as e:
        raise ValueError(f"checkpoint tensor {name} in {file} {e}.") from e


def _fill_dummy(model: torch.nn.Module, seed: int) -> None:
    """Biases 0, norm weights 1, everything else normal(0, 0.02); same seed, same values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.zero_()
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=generator)
                param.copy_(values)
    logger.info("filled %s with dummy weights (seed %d)", type(model).__name__, seed)
