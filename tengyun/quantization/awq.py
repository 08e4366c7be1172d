"""AutoAWQ's GEMM checkpoints (quant_method "awq", version "gemm"), as AutoAWQ writes them and
vLLM's AWQ loads them: 4-bit weights with a zero point per group of input features.

    qweight int32 [in, out / 8]         8 outputs per word, packed in AWQ's order: nibble j
                                        (bits 4j..4j+3) of word w holds output 8w + (0, 2, 4, 6, 1, 3, 5, 7)[j]
    qzeros  int32 [in / group, out / 8] the zero points, packed the same way
    scales  fp16  [in / group, out]
    w[o, i] = (q[i, o] - z[i // group, o]) * s[i // group, o], q and z unsigned in [0, 15]

config.json's quantization_config (AutoAWQ, or transformers' AwqConfig): ``bits`` (``w_bit``) 4,
``group_size`` (``q_group_size``) 32, 64 or 128, ``zero_point`` true, ``version`` "gemm",
``modules_to_not_convert``: module-name substrings kept unquantised. Torch-free (the planner
reads it); tengyun/quantization/awq_gptq_packing.py unpacks the tensors.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from tengyun.quantization.config import QuantConfig, QuantGroup, QuantizationError
from tengyun.quantization.scheme import ACT, IN, OUT, LinearScheme, TensorLayout

METHOD = "awq"
BITS = (4,)
GROUP_SIZES = (32, 64, 128)
VERSIONS = ("gemm",)
# Never quantised by AutoAWQ checkpoints vLLM loads: the head, MoE routers, Qwen2-MoE's one-output shared-expert gate
ALWAYS_IGNORED = ("lm_head", r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$")


def gemm_scheme(group_size: int) -> LinearScheme:
    return LinearScheme(
        kernel="wna16_int", weight_bits=4, group_size=group_size, symmetric=False, packing="awq",
        description=f"AWQ GEMM (int4, group {group_size}, zero point)",
        tensors=(TensorLayout("qweight", "int32", ((IN, 1), (OUT, 8))),
                 TensorLayout("qzeros", "int32", ((IN, group_size), (OUT, 8))),
                 TensorLayout("scales", ACT, ((IN, group_size), (OUT, 1)))))


def _field(quant: Mapping[str, Any], *names: str, default: Any = None) -> tuple[str, Any]:
    """(the name config.json uses, its value) of the first of ``names`` present."""
    for name in names:
        if name in quant:
            return name, quant[name]
    return names[0], default


def _require(field: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        shown = ", ".join(repr(a) if isinstance(a, str) else str(a).lower() for a in allowed)
        raise QuantizationError(f"quantization_config.{field} is {value!r}; Tengyun's AWQ reader supports {shown}.")


def not_converted(modules: Any) -> tuple[str, ...]:
    """modules_to_not_convert (substrings of module names, as AutoAWQ and vLLM match them) ->
    QuantConfig ignore patterns."""
    return tuple(f"re:.*{re.escape(m)}" for m in (modules or ()))


def from_config(quant: Mapping[str, Any]) -> QuantConfig:
    """config.json's quantization_config -> QuantConfig; raises QuantizationError naming the field."""
    field, bits = _field(quant, "bits", "w_bit", default=4)
    _require(field, bits, BITS)
    field, group_size = _field(quant, "group_size", "q_group_size", default=128)
    _require(field, group_size, GROUP_SIZES)
    _require("zero_point", quant.get("zero_point", True), (True,))
    version = quant.get("version", "gemm")
    _require("version", version.lower() if isinstance(version, str) else version, VERSIONS)
    ignore = ALWAYS_IGNORED + not_converted(quant.get("modules_to_not_convert"))
    return QuantConfig(METHOD, (QuantGroup(("Linear",), gemm_scheme(group_size)),), ignore)
