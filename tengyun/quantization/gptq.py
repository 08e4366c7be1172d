"""AutoGPTQ / GPTQModel checkpoints (quant_method "gptq"), as vLLM loads them: 4- or 8-bit
weights, pack = 32 / bits values per int32, a zero point per group of input features.

    qweight int32 [in / pack, out]        packed along the inputs: input i in bits
                                          bits * (i % pack).. of word i // pack, unsigned
    qzeros  int32 [groups, out / pack]    packed along the outputs the same way
    scales  fp16  [groups, out]
    g_idx   int32 [in]                    the group of each input feature
    w[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o], q and z unsigned in [0, 2^bits)

``checkpoint_format`` "gptq" (v1, AutoGPTQ's and GPTQModel's default) stores each zero minus one
(z = stored + 1); "gptq_v2" stores z. ``sym`` true: every zero is 2^(bits-1) (checked at load,
then qzeros is dropped). ``desc_act`` false: g_idx[i] = i // group (checked, then dropped); true
(act order): g_idx is any assignment of inputs to groups, kept, and a row-parallel rank, whose
slice of the inputs may use any group, holds every group's scales and zeros (``split_in=False``).
``group_size`` -1: one group (per output channel). Torch-free (the planner reads it);
tengyun/quantization/awq_gptq_packing.py unpacks the tensors.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from tengyun.quantization.awq import ALWAYS_IGNORED
from tengyun.quantization.config import QuantConfig, QuantGroup, QuantizationError
from tengyun.quantization.scheme import ACT, IN, OUT, LinearScheme, TensorLayout

METHOD = "gptq"
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128, 256, -1)  # -1: one group over all inputs
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


def scheme(bits: int, group_size: int, symmetric: bool, act_order: bool, checkpoint_format: str) -> LinearScheme:
    pack = 32 // bits
    act_order = act_order and group_size != -1  # one group: the order of the inputs cannot matter
    group = None if group_size == -1 else group_size
    group_dim = 1 if group is None else (IN, group)  # per channel: one row of scales on every rank
    order = ", act order" if act_order else ""
    grouping = f"group {group}" if group else "per channel"
    return LinearScheme(
        kernel="wna16_int", weight_bits=bits, group_size=group, symmetric=symmetric, packing=checkpoint_format,
        description=f"GPTQ W{bits}A16 (int{bits}, {grouping}, {'' if symmetric else 'a'}symmetric{order}, "
                    f"{checkpoint_format})",
        tensors=(TensorLayout("qweight", "int32", ((IN, pack), (OUT, 1))),
                 TensorLayout("qzeros", "int32", (group_dim, (OUT, pack)), split_in=not act_order, kept=not symmetric),
                 TensorLayout("scales", ACT, (group_dim, (OUT, 1)), split_in=not act_order),
                 TensorLayout("g_idx", "int32", ((IN, 1),), kept=act_order)))


def _require(field: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        shown = ", ".join(repr(a) if isinstance(a, str) else str(a).lower() for a in allowed)
        raise QuantizationError(f"quantization_config.{field} is {value!r}; Tengyun's GPTQ reader supports {shown}.")


def checkpoint_format(quant: Mapping[str, Any]) -> str:
    """"gptq" (zeros stored minus one) or "gptq_v2"; GPTQModel also writes it as ``format``."""
    field = "checkpoint_format" if "checkpoint_format" in quant else "format"
    value = quant.get(field) or "gptq"
    _require(field, value.lower() if isinstance(value, str) else value, CHECKPOINT_FORMATS)
    return value.lower()


def _targets(quant: Mapping[str, Any]) -> tuple[str, ...]:
    """modules_in_block_to_quantize ([["self_attn.q_proj", ...], ["mlp.down_proj"]], or flat) ->
    targets matching those modules in every layer; absent: every linear layer."""
    listed = quant.get("modules_in_block_to_quantize")
    if not listed:
        return ("Linear",)
    flat = [m for item in listed for m in (item if isinstance(item, list) else [item])]
    return tuple(f"re:.*\\.{re.escape(m)}$" for m in flat)


def from_config(quant: Mapping[str, Any]) -> QuantConfig:
    """config.json's quantization_config (or quantize_config.json) -> QuantConfig; raises
    QuantizationError naming the field and the supported values."""
    _require("bits", quant.get("bits"), BITS)
    _require("group_size", quant.get("group_size"), GROUP_SIZES)
    _require("sym", quant.get("sym", True), (True, False))
    _require("desc_act", quant.get("desc_act", False), (True, False))
    if quant.get("lm_head"):
        raise QuantizationError("quantization_config.lm_head is true (a quantised lm_head): Tengyun runs GPTQ "
                                "linear layers of the decoder only; re-quantize with lm_head false.")
    if quant.get("dynamic"):
        raise QuantizationError("quantization_config.dynamic (GPTQModel's per-module overrides) is not supported: "
                                "re-quantize with one bits / group_size for every module.")
    chosen = scheme(quant["bits"], quant["group_size"], bool(quant.get("sym", True)), bool(quant.get("desc_act")),
                    checkpoint_format(quant))
    return QuantConfig(METHOD, (QuantGroup(_targets(quant), chosen),), ALWAYS_IGNORED)
