"""A PEFT LoRA folder read and checked against the base model, without torch.

    adapter_config.json        r, lora_alpha, use_rslora, target_modules, modules_to_save, ...
    adapter_model.safetensors  base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_A.weight [r, in]
                               ... .lora_B.weight [out, r]

Every check runs on the config and the safetensors header (8-byte length, then JSON with each
tensor's shape), so the engine refuses a bad adapter (a ValueError: HTTP 400 at run time, exit 2
at start-up) before any worker loads it. Each message names the adapter and the module.

The product an adapter adds is ``scaling * B @ A @ x``, scaling = lora_alpha / r, or
lora_alpha / sqrt(r) with use_rslora (rank-stabilised LoRA).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from tengyun.lora.request import LoRARequest
from tengyun.lora.targets import TARGETS, module_shape
from tengyun.model_spec import ModelSpec

CONFIG_FILE, WEIGHTS_FILE, PICKLE_FILE = "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight -> (3, "self_attn", "q_proj", "A")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class LoRAAdapterError(ValueError):
    """An adapter Tengyun cannot serve; the message names the adapter, the module and the fix."""


class LoRAAdapterNotFound(LoRAAdapterError):
    """No adapter at the path (no folder, or no adapter_config.json in it): vLLM's 404 at run time."""


@dataclass(frozen=True)
class ModuleWeights:
    """One targeted module of one decoder layer: its tensors' names in the safetensors file."""

    layer: int
    module: str  # "q_proj"
    a_key: str  # [rank, in]
    b_key: str  # [out, rank]


@dataclass(frozen=True)
class PeftAdapter:
    request: LoRARequest
    weights_file: Path
    rank: int
    scaling: float
    modules: tuple[ModuleWeights, ...]


def read_peft_adapter(request: LoRARequest, spec: ModelSpec, max_lora_rank: int) -> PeftAdapter:
    """The adapter of ``request``, checked against ``spec`` and --max-lora-rank; raises LoRAAdapterError."""
    what = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    folder = Path(request.lora_path).expanduser()
    if not (folder / CONFIG_FILE).is_file():
        # vLLM's words ("Loading lora x failed: No adapter found for PATH"), then what is missing
        raise LoRAAdapterNotFound(f"Loading lora {request.lora_name} failed: No adapter found for "
                                  f"{request.lora_path}. {what}: no {CONFIG_FILE} there; pass the folder "
                                  f"PEFT's save_pretrained wrote.")
    config = json.loads((folder / CONFIG_FILE).read_text())
    rank = _check_config(what, config, max_lora_rank)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        if (folder / PICKLE_FILE).is_file():
            raise LoRAAdapterError(f"{what}: holds {PICKLE_FILE} (a pickle, which can run code when read); "
                                   f"Tengyun loads {WEIGHTS_FILE} only: re-save it with "
                                   f"save_pretrained(safe_serialization=True).")
        raise LoRAAdapterError(f"{what}: no {WEIGHTS_FILE} there.")
    shapes = _header_shapes(weights)
    modules = _check_tensors(what, shapes, spec, rank)
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return PeftAdapter(request, weights, rank, scaling, modules)


def _check_config(what: str, config: dict, max_lora_rank: int) -> int:
    """The adapter's rank, once adapter_config.json asks for nothing Tengyun does not do."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{what}: peft_type {config['peft_type']!r}; Tengyun serves LORA adapters only.")
    # the first sentences of the next four are vLLM's (its PEFTHelper's), which clients match on
    if config.get("modules_to_save"):
        raise LoRAAdapterError(f"{what}: Tengyun only supports modules_to_save being None; got modules_to_save "
                               f"{config['modules_to_save']} (whole modules trained beside the adapter): train it "
                               f"without modules_to_save.")
    if config.get("use_dora"):
        raise LoRAAdapterError(f"{what}: Tengyun does not yet support DoRA (use_dora).")
    for key, why in (("rank_pattern", "per-module ranks"),
                     ("alpha_pattern", "per-module alphas"), ("lora_bias", "a bias on lora_B")):
        if config.get(key):
            raise LoRAAdapterError(f"{what}: {key} ({why}) is not supported.")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{what}: Adapter bias cannot be used without bias_enabled: bias "
                               f"{config['bias']!r} (trained base biases); Tengyun has no --enable-lora-bias, "
                               f"use bias 'none'.")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            raise LoRAAdapterError(f"{what}: target module {unknown[0]!r} is not one Tengyun applies LoRA to "
                                   f"({', '.join(TARGETS)}).")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"{what}: r must be a positive integer; got {rank!r}.")
    if rank > max_lora_rank:
        raise LoRAAdapterError(f"{what}: LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}: start "
                               f"with --max-lora-rank {_next_rank(rank)}.")
    return rank


def _next_rank(rank: int) -> int:
    return next((r for r in (8, 16, 32, 64, 128, 256, 320, 512) if r >= rank), rank)


def _header_shapes(path: Path) -> dict[str, list[int]]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {key: meta["shape"] for key, meta in header.items() if key != "__metadata__"}


def _check_tensors(what: str, shapes: dict[str, list[int]], spec: ModelSpec, rank: int) -> tuple[ModuleWeights, ...]:
    """Every tensor a lora_A / lora_B of a target Tengyun applies, in the base model's shapes."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    for key in sorted(shapes):
        match = _KEY.match(key)
        if match is None or match.group(3) not in TARGETS or _PARENT[match.group(3)] != match.group(2):
            raise LoRAAdapterError(f"{what}: tensor {key} is not a lora_A / lora_B of a module Tengyun applies "
                                   f"LoRA to ({', '.join(TARGETS)} of model.layers.<i>).")
        layer, module = int(match.group(1)), match.group(3)
        if layer >= spec.num_layers:
            raise LoRAAdapterError(f"{what}: {key} is for layer {layer}, but the base model has "
                                   f"{spec.num_layers} layers: was it trained on another model?")
        found.setdefault((layer, module), {})[match.group(4)] = key
    modules = []
    for (layer, module), keys in sorted(found.items()):
        name = f"model.layers.{layer}.{_PARENT[module]}.{module}"
        if set(keys) != {"A", "B"}:
            raise LoRAAdapterError(f"{what}: {name} has lora_{next(iter(keys))} but not its other half.")
        in_, out = module_shape(spec, module)
        for half, got, want in (("A", shapes[keys["A"]], [rank, in_]), ("B", shapes[keys["B"]], [out, rank])):
            if list(got) != want:
                raise LoRAAdapterError(f"{what}: {name}.lora_{half} is {list(got)} but the base model needs {want} "
                                       f"(r {rank}, in {in_}, out {out}): was it trained on another model?")
        modules.append(ModuleWeights(layer, module, keys["A"], keys["B"]))
    if not modules:
        raise LoRAAdapterError(f"{what}: {WEIGHTS_FILE} holds no lora_A / lora_B tensors.")
    return tuple(modules)
