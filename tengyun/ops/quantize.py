"""`tengyun quantize`: round-to-nearest W8A8 or W4A16 into a compressed-tensors folder.

Every linear weight of the decoder layers (the q/k/v/o and gate/up/down projections, MoE
experts' and shared experts' included; the Gated DeltaNet's in_proj_qkv, in_proj_z and out_proj
of Qwen3.5, in_proj_qkvz and out_proj of Qwen3-Next) is quantised as llm-compressor's W8A8 / W4A16
presets do, with its default ignore list (lm_head; the embeddings are not linear layers; MoE
routers kept, as its Qwen3-MoE examples do): symmetric min-max scales, round to nearest (no
calibration data). Qwen3.5 and Qwen3-Next keep in 16 bits what their layers would not quantise
whole: the one-row shared_expert_gate, the per-head in_proj_b / in_proj_a (Qwen3-Next's
in_proj_ba; vLLM runs them as one in_proj_ba layer), and the vision tower and MTP layers a
multimodal checkpoint holds (not decoder layers: copied as stored, and ignored by name).
With ``--quantize-lm-head`` the LM head is quantised too, targeted by name as vLLM loads it (a
model that ties its head to the embedding, SmolLM2, is untied: ``lm_head`` is quantised from the
embedding, which stays as stored for the token lookups, and config.json says
``tie_word_embeddings: false``; vLLM loads such a folder as any untied one):
W8A8 like the rest; W4A16 at 8 bits per channel (W8A16, as llama.cpp's own 4-bit files keep their
output tensor at 6 or 8 bits: Q8_0 in Qwen2.5-Coder-0.5B's Q4_0 file). At batch 1 the head is the
largest read of a small model (Qwen2.5-Coder-0.5B: 272 MB of 16-bit head, 180 MB of 4-bit
decoder). vLLM's CPU build (0.32) runs no 8-bit weight-only layer (its CPU WNA16 kernel takes 4
bits), so it refuses the W4A16 folder with such a head; its GPU kernels (Marlin) take 8 bits.
Everything else is copied as stored. The folder holds config.json with the quantization_config
compressed-tensors 0.20.1 writes, the safetensors (one per input shard, same names, with an index
when the input had one) and every other file of the input (tokenizer, generation_config.json, ...).
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from tengyun.model_spec import ModelSpec
from tengyun.models.loader import INDEX_FILE, safetensors_files
from tengyun.quantization import compressed_tensors
from tengyun.quantization.packing import pack_int32, quantize_symmetric
from tengyun.quantization.scheme import LinearScheme

SCHEMES = ("w8a8", "w4a16")
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                 "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                 "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM")
# llm-compressor's default ignore list, plus the MoE routers its Qwen3-MoE examples keep in 16 bits
IGNORE = ("lm_head", "re:.*mlp.gate$")
# Qwen3.5 (hybrid) checkpoints also keep these unquantised (the module docstring says why)
HYBRID_IGNORE = ("re:.*mlp.shared_expert_gate$", "re:.*linear_attn.in_proj_(a|b|ba)$", "re:.*visual.*", "re:^mtp.*")
HEAD_WEIGHT = f"{compressed_tensors.HEAD_TARGET}.weight"  # what --quantize-lm-head quantises
EMBEDDINGS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")  # a tied head's source
_DECODER_PREFIXES = ("model.layers.", "model.language_model.layers.")  # text-only, multimodal layout
_GATED_DELTA_NET = ("in_proj_qkv", "in_proj_z", "in_proj_qkvz", "out_proj")  # Qwen3.5's, Qwen3-Next's in_proj_qkvz
_LINEAR_SUFFIXES = (tuple(f".{p}_proj.weight" for p in ("q", "k", "v", "o", "gate", "up", "down"))
                    + tuple(f".linear_attn.{p}.weight" for p in _GATED_DELTA_NET))


@dataclass(frozen=True)
class QuantizeResult:
    out_dir: Path
    quantized: int  # linear weights quantised
    copied: int  # tensors copied as stored
    bytes_in: int
    bytes_out: int


def scheme_for(scheme: str, group_size: int | None) -> LinearScheme:
    if scheme == "w8a8":
        return compressed_tensors.w8a8_scheme()
    return compressed_tensors.weight_only_scheme(4, group_size, symmetric=True)


def is_quantized_linear(name: str, tensor_dims: int) -> bool:
    return tensor_dims == 2 and name.startswith(_DECODER_PREFIXES) and name.endswith(_LINEAR_SUFFIXES)


def ignore_list(config: dict, head: bool = False) -> tuple[str, ...]:
    """The modules a quantised folder of ``config``'s model keeps unquantised (compressed-tensors'
    ``ignore``): lm_head (unless ``head``); MoE routers; Qwen3.5's HYBRID_IGNORE."""
    spec = ModelSpec.from_hf_config(config)
    ignore = IGNORE if spec.moe is not None else IGNORE[:1]
    ignore = ignore[1:] if head else ignore
    return ignore + HYBRID_IGNORE if spec.architecture.startswith(("Qwen3_5", "Qwen3Next")) else ignore


def check_model(config: dict, scheme: str, group_size: int | None) -> None:
    """Refuse what Tengyun would not run: another architecture, an unknown scheme or group size."""
    if scheme not in SCHEMES:
        raise ValueError(f"--scheme {scheme!r} is not one of {', '.join(SCHEMES)}.")
    if scheme == "w4a16" and group_size is not None and group_size not in compressed_tensors.GROUP_SIZES:
        raise ValueError(f"--group-size {group_size} is not supported; use one of "
                         f"{', '.join(map(str, compressed_tensors.GROUP_SIZES))} (or 0 for one scale per channel).")
    if config.get("quantization_config"):
        raise ValueError("MODEL_DIR is already quantized (config.json has a quantization_config): "
                         "quantize the unquantized checkpoint.")
    arch = ModelSpec.from_hf_config(config).architecture  # GGUF conversions name only model_type
    if arch not in ARCHITECTURES:
        raise ValueError(f"`tengyun quantize` handles {', '.join(ARCHITECTURES)}; config.json says {arch}.")


def quantize_folder(model_dir: Path, out_dir: Path, scheme: str, group_size: int | None = 128,
                    progress: bool | None = None, head: bool = False) -> QuantizeResult:
    """``head``: quantise the LM head too (--quantize-lm-head; a tied one from the embedding, untied)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = json.loads((model_dir / "config.json").read_text())
    check_model(config, scheme, group_size)
    group_size = group_size if scheme == "w4a16" else None
    tied = head and ModelSpec.from_hf_config(config).tie_word_embeddings
    config = _untied(config) if tied else config
    files = safetensors_files(model_dir)
    head_source = _head_source(files, tied) if head else None
    section = compressed_tensors.quantization_config(scheme, group_size, ignore_list(config, head), head)
    # the head's scheme as the written config gives it (Tengyun and vLLM read it from there)
    head_layout = compressed_tensors.from_config(section).head_scheme(compressed_tensors.HEAD_TARGET) if head else None
    layouts = {"linear": scheme_for(scheme, group_size), "head": head_layout}
    _check_shapes(files, layouts, group_size, head_source)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"OUT_DIR {out_dir} exists and is not empty: pass a new folder.")
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {"quantized": 0, "copied": 0, "in": 0, "out": 0}
    weight_map: dict[str, str] = {}
    total = sum(len(safe_open(f, framework="pt").keys()) for f in files)
    show = sys.stderr.isatty() if progress is None else progress
    with tqdm(total=total, desc=f"Quantizing to {scheme.upper()}", unit="tensor", disable=not show) as bar:
        for f in files:
            tensors = _quantize_file(f, layouts, counts, bar, head_source)
            save_file(tensors, str(out_dir / f.name), metadata={"format": "pt"})
            weight_map.update({name: f.name for name in tensors})
    _write_metadata(model_dir, out_dir, {**config, "quantization_config": section}, weight_map, counts["out"])
    return QuantizeResult(out_dir, counts["quantized"], counts["copied"], counts["in"], counts["out"])


def _untied(config: dict) -> dict:
    """config.json with tie_word_embeddings false wherever it says true (the top level; a
    multimodal wrapper's text_config too): the written folder holds its own lm_head."""
    untied = {**config, "tie_word_embeddings": False}
    if isinstance(config.get("text_config"), dict) and "tie_word_embeddings" in config["text_config"]:
        untied["text_config"] = {**config["text_config"], "tie_word_embeddings": False}
    return untied


def _head_source(files: list[Path], tied: bool) -> str | None:
    """The tensor --quantize-lm-head quantises into lm_head: lm_head.weight; a tied model's
    embedding where it stores no lm_head.weight; None where neither is stored."""
    names = {name for f in files for name in safe_open(f, framework="pt").keys()}
    return next((name for name in (HEAD_WEIGHT, *(EMBEDDINGS if tied else ())) if name in names), None)


def _layout_of(name: str, dims: int, layouts: dict[str, LinearScheme | None],
               head_source: str | None) -> LinearScheme | None:
    """The scheme tensor ``name`` is quantised to, or None: copied as stored."""
    if name == head_source and dims == 2:
        return layouts["head"]
    return layouts["linear"] if is_quantized_linear(name, dims) else None


def _check_shapes(files: list[Path], layouts: dict[str, LinearScheme | None], group_size: int | None,
                  head_source: str | None) -> None:
    heads = 0
    for f in files:
        with safe_open(f, framework="pt") as reader:
            for name in reader.keys():
                shape = reader.get_slice(name).get_shape()
                layout = _layout_of(name, len(shape), layouts, head_source)
                heads += layout is not None and name == head_source
                if layout is None:
                    continue
                problem = layout.shape_problem(*shape)
                if problem:
                    fits = [g for g in compressed_tensors.GROUP_SIZES if shape[1] % g == 0]
                    hint = (f"; pass --group-size {fits[-1]}" if fits and group_size else "")
                    raise ValueError(f"{name} [{shape[0]}, {shape[1]}] cannot be quantized: {problem}{hint}.")
    if layouts["head"] is not None and not heads:
        raise ValueError(f"--quantize-lm-head: MODEL_DIR's safetensors hold no {HEAD_WEIGHT} (nor, where the config "
                         f"ties the head to the embedding, {EMBEDDINGS[0]}): the checkpoint is incomplete.")


def _quantize_file(path: Path, layouts: dict[str, LinearScheme | None], counts: dict, bar,
                   head_source: str | None) -> dict[str, torch.Tensor]:
    """``head_source``'s tensor is quantised as lm_head (an embedding is also kept as stored)."""
    out: dict[str, torch.Tensor] = {}
    with safe_open(path, framework="pt") as reader:
        for name in reader.keys():
            tensor = reader.get_tensor(name)
            counts["in"] += tensor.numel() * tensor.element_size()
            layout = _layout_of(name, tensor.dim(), layouts, head_source)
            if layout is not None:
                module = compressed_tensors.HEAD_TARGET if name == head_source else name.removesuffix(".weight")
                out.update(_quantize_weight(module, tensor, layout))
                counts["quantized"] += 1
            if layout is None or name in EMBEDDINGS:  # an embedding made lm_head stays for the token lookups
                out[name] = tensor.contiguous()
                counts["copied"] += 1
            bar.update(1)
    counts["out"] += sum(t.numel() * t.element_size() for t in out.values())
    return out


def _quantize_weight(module: str, weight: torch.Tensor, layout: LinearScheme) -> dict[str, torch.Tensor]:
    """weight [out, in] -> the scheme's tensors (compressed_tensors.py), scales in weight's dtype."""
    q, scale = quantize_symmetric(weight, layout.weight_bits, layout.group_size)
    if layout.kernel == "w8a8_int8":
        return {f"{module}.weight": q, f"{module}.weight_scale": scale.reshape(-1, 1).contiguous()}
    return {f"{module}.weight_packed": pack_int32(q, layout.weight_bits),
            f"{module}.weight_scale": scale.reshape(weight.shape[0], -1).contiguous(),
            f"{module}.weight_shape": torch.tensor(list(weight.shape), dtype=torch.int64)}


def _write_metadata(model_dir: Path, out_dir: Path, config: dict, weight_map: dict[str, str],
                    total_size: int) -> None:
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if (model_dir / INDEX_FILE).is_file():
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INDEX_FILE):
            shutil.copy2(f, out_dir / f.name)
