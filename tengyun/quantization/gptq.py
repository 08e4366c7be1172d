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
# quantization_config fields Tengyun reads (also as `dynamic` overrides): (allowed values, default)
_FIELDS = {"bits": (BITS, None), "group_size": (GROUP_SIZES, None), "sym": ((True, False), True),
           "desc_act": ((True, False), False)}


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
    for field, (allowed, default) in _FIELDS.items():
        _require(field, quant.get(field, default), allowed)
    if quant.get("lm_head"):
        raise QuantizationError("quantization_config.lm_head is true (a quantised lm_head): Tengyun runs GPTQ "
                                "linear layers of the decoder only; re-quantize with lm_head false.")
    base = QuantGroup(_targets(quant), _scheme_of(quant, checkpoint_format(quant)))
    return QuantConfig(METHOD, (*_dynamic_groups(quant), base), ALWAYS_IGNORED)


def _scheme_of(fields: Mapping[str, Any], fmt: str) -> LinearScheme:
    return scheme(fields["bits"], fields["group_size"], bool(fields.get("sym", True)), bool(fields.get("desc_act")),
                  fmt)


def _dynamic_groups(quant: Mapping[str, Any]) -> list[QuantGroup]:
    """GPTQModel's ``dynamic`` {pattern: overrides}, read as vLLM reads it: in order, the first
    pattern matching a module (re.match) decides; "-:<regex>" leaves the module unquantised,
    "+:<regex>" (or a bare regex) quantises it with ``bits`` / ``group_size`` / ``sym`` /
    ``desc_act`` overriding the top-level values."""
    dynamic = quant.get("dynamic") or {}
    if not isinstance(dynamic, Mapping):
        raise QuantizationError("quantization_config.dynamic must map module regexes (\"-:<regex>\" to skip, "
                                "\"+:<regex>\" to override bits / group_size / sym / desc_act) to overrides.")
    groups = []
    for pattern, overrides in dynamic.items():
        if pattern.startswith("-:"):
            groups.append(QuantGroup((f"re:{pattern[2:]}",), None))
            continue
        overrides = overrides or {}
        for field in overrides.keys() & _FIELDS.keys():
            _require(f"dynamic[{pattern!r}].{field}", overrides[field], _FIELDS[field][0])
        fields = {**quant, **overrides}
        groups.append(QuantGroup((f"re:{pattern.removeprefix('+:')}",), _scheme_of(fields, checkpoint_format(quant))))
    return groups
