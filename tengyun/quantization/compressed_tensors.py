"""compressed-tensors, the format llm-compressor writes and vLLM loads (quant_method
"compressed-tensors"). Tengyun runs two of its schemes:

- W8A8 int8, format "int-quantized": ``weight`` int8 [out, in], ``weight_scale`` [out, 1] (one
  scale per output channel, symmetric); activations quantised per token at run time
  (input_activations: strategy "token", dynamic, symmetric): y = (x_q @ w_q^T) * s_x * s_w.
- W4A16 / W8A16, format "pack-quantized": ``weight_packed`` int32 [out, in * bits / 32] (value
  + 2^(bits-1) as an unsigned field, element i of a row at bits [bits * i % 32, ...) of word
  bits * i // 32: compressed-tensors' pack_to_int32), ``weight_scale`` [out, in / group] (or
  [out, 1] per channel), ``weight_shape`` int64 [2] = [out, in]; asymmetric adds
  ``weight_zero_point`` int32 [out * bits / 32, in / group], packed along the outputs. Dequantized
  w = (q - zero) * scale.

Torch-free; ``quantization_config`` writes config.json's section as compressed-tensors 0.20.1's
ModelCompressor.update_config does (`tengyun quantize`).
"""

from __future__ import annotations

from typing import Any, Mapping

from tengyun.quantization.config import QuantConfig, QuantGroup, QuantizationError
from tengyun.quantization.scheme import ACT, IN, OUT, LinearScheme, TensorLayout

METHOD = "compressed-tensors"
FORMAT_VERSION = "0.20.1"  # the compressed-tensors release whose layout `tengyun quantize` writes
WEIGHT_ONLY_BITS = (4, 8)
GROUP_SIZES = (32, 64, 128, 256)  # or per channel (strategy "channel")


def w8a8_scheme() -> LinearScheme:
    return LinearScheme(
        kernel="w8a8_int8", weight_bits=8, group_size=None, symmetric=True,
        description="compressed-tensors W8A8 (int8 per-channel weights, dynamic per-token int8 activations)",
        tensors=(TensorLayout("weight", "int8", ((OUT, 1), (IN, 1))),
                 TensorLayout("weight_scale", ACT, ((OUT, 1), 1))))


def weight_only_scheme(bits: int, group_size: int | None, symmetric: bool) -> LinearScheme:
    per_word = 32 // bits
    scale_dims = ((OUT, 1), (IN, group_size)) if group_size else ((OUT, 1), 1)
    tensors = [TensorLayout("weight_packed", "int32", ((OUT, 1), (IN, per_word))),
               TensorLayout("weight_scale", ACT, scale_dims),
               TensorLayout("weight_shape", "int64", (2,), kept=False)]
    if not symmetric:
        zero_dims = ((OUT, per_word), (IN, group_size)) if group_size else ((OUT, per_word), 1)
        tensors.append(TensorLayout("weight_zero_point", "int32", zero_dims))
    grouping = f"group {group_size}" if group_size else "per channel"
    return LinearScheme(
        kernel="wna16_int", tensors=tuple(tensors), weight_bits=bits, group_size=group_size, symmetric=symmetric,
        description=f"compressed-tensors W{bits}A16 (int{bits}, {grouping}, {'' if symmetric else 'a'}symmetric)")


def from_config(quant: Mapping[str, Any]) -> QuantConfig:
    """config.json's quantization_config -> QuantConfig; raises QuantizationError naming the field."""
    groups = quant.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise QuantizationError("quantization_config.config_groups is missing or empty: a compressed-tensors "
                                "checkpoint names its schemes there (re-export it with llm-compressor or "
                                "`tengyun quantize`).")
    status = quant.get("quantization_status", "compressed")
    if status != "compressed":
        raise QuantizationError(f"quantization_config.quantization_status is {status!r}: Tengyun loads "
                                f"\"compressed\" checkpoints (save with save_compressed=True).")
    parsed = tuple(QuantGroup(tuple(group.get("targets") or ("Linear",)),
                              _scheme(f"config_groups.{name}", group, group.get("format") or quant.get("format")))
                   for name, group in groups.items())
    return QuantConfig(METHOD, parsed, tuple(quant.get("ignore") or ()), named_head=True)


def _scheme(where: str, group: Mapping[str, Any], fmt: str | None) -> LinearScheme:
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    _require(where, "weights.type", weights.get("type", "int"), ("int",))
    _require(where, "weights.dynamic", bool(weights.get("dynamic", False)), (False,))
    if weights.get("actorder") not in (None, "static"):
        raise QuantizationError(f"quantization_config.{where}.weights.actorder {weights.get('actorder')!r} (stored "
                                f"with weight_g_idx) is not supported: re-quantize with actorder null or \"static\".")
    if fmt == "int-quantized":
        _require(where, "weights.num_bits", weights.get("num_bits"), (8,))
        _require(where, "weights.strategy", weights.get("strategy"), ("channel",))
        _require(where, "weights.symmetric", weights.get("symmetric", True), (True,))
        if not acts:
            raise QuantizationError(f"quantization_config.{where}: int-quantized weights without "
                                    f"input_activations (W8A16) are not supported; use pack-quantized for W8A16.")
        for field, allowed in (("num_bits", (8,)), ("type", ("int",)), ("strategy", ("token",)),
                               ("dynamic", (True,)), ("symmetric", (True,))):
            _require(where, f"input_activations.{field}", acts.get(field), allowed)
        return w8a8_scheme()
    if fmt == "pack-quantized":
        if acts:
            raise QuantizationError(f"quantization_config.{where}: pack-quantized weights with input_activations "
                                    f"are not supported; Tengyun runs pack-quantized as weight-only (W4A16, W8A16).")
        _require(where, "weights.num_bits", weights.get("num_bits"), WEIGHT_ONLY_BITS)
        strategy = weights.get("strategy")
        _require(where, "weights.strategy", strategy, ("group", "channel"))
        group_size = weights.get("group_size") if strategy == "group" else None
        if strategy == "group":
            _require(where, "weights.group_size", group_size, GROUP_SIZES)
        return weight_only_scheme(weights["num_bits"], group_size, bool(weights.get("symmetric", True)))
    raise QuantizationError(f"quantization_config format {fmt!r} ({where}) is not supported; Tengyun reads "
                            f"\"int-quantized\" (W8A8 int8) and \"pack-quantized\" (W4A16, W8A16).")


def _require(where: str, field: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        shown = ", ".join(str(a).lower() if isinstance(a, bool) else repr(a) if isinstance(a, str) else str(a)
                          for a in allowed)
        raise QuantizationError(f"quantization_config.{where}.{field} is {value!r}; Tengyun supports {shown}.")


def _args(bits: int, strategy: str, group_size: int | None, dynamic: bool) -> dict[str, Any]:
    return {"num_bits": bits, "type": "int", "symmetric": True, "group_size": group_size, "strategy": strategy,
            "dynamic": dynamic}


HEAD_TARGET = "lm_head"  # the name a config group targets an untied LM head by (vLLM matches it so)


def quantization_config(scheme: str, group_size: int | None = 128, ignore: tuple[str, ...] = ("lm_head",),
                        head: bool = False) -> dict[str, Any]:
    """config.json's quantization_config for ``scheme`` "w8a8" or "w4a16", as llm-compressor
    (compressed-tensors 0.20.1) writes it for its W8A8 and W4A16 presets. ``head``: the LM head is
    quantised too, targeted by name (not in ``ignore``): w8a8 in the same group, w4a16 in a second
    group as W8A16 per channel (8 bits: llama.cpp's Q4_0 file of Qwen2.5-Coder-0.5B keeps its output
    tensor at Q8_0 too)."""
    if scheme == "w8a8":
        group = {"weights": _args(8, "channel", None, False), "input_activations": _args(8, "token", None, True)}
        fmt = "int-quantized"
    else:
        strategy = "group" if group_size else "channel"
        group = {"weights": _args(4, strategy, group_size, False), "input_activations": None}
        fmt = "pack-quantized"
    groups = {"group_0": {"targets": ["Linear"], **group, "output_activations": None, "format": None}}
    if head and scheme == "w8a8":
        groups["group_0"]["targets"].append(HEAD_TARGET)
    elif head:
        groups["group_1"] = {"targets": [HEAD_TARGET], "weights": _args(8, "channel", None, False),
                             "input_activations": None, "output_activations": None, "format": None}
    return {
        "config_groups": groups,
        "format": fmt, "global_compression_ratio": None, "ignore": list(ignore), "kv_cache_scheme": None,
        "moe_sparsity_config": None, "quant_method": METHOD, "quantization_status": "compressed",
        "sparsity_config": {}, "transform_config": {}, "version": FORMAT_VERSION,
    }
