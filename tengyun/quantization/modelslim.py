"""Ascend msModelSlim checkpoints, as vLLM-Ascend loads them (quant_method "ascend").

The model folder holds quant_model_description.json beside the safetensors: {tensor name: quant
type} for every tensor, plus metadata keys without a dot ("model_quant_type": "W8A8_DYNAMIC",
"version", "fa_quant_type", ...). A linear layer's type is its ``<module>.weight`` entry;
"FLOAT" keeps it dense. Tengyun runs two types:

- W8A8_DYNAMIC: ``weight`` int8 [out, in], ``weight_scale`` [out, 1], ``weight_offset`` [out, 1]
  (zeros: symmetric); activations quantised per token at run time, the w8a8_int8 kernel kind:
  y = (x_q @ w^T) * s_x * weight_scale + bias.
- W8A8 (static): ``weight``, ``weight_scale``, ``weight_offset`` as above, plus one activation
  scale and zero point for the whole tensor, ``input_scale`` [1] and ``input_offset`` [1] (an
  integer, stored as a float or int8), and per output ``deq_scale`` [out] (float32; from a
  float16 model int64 holding the float32's bits) and ``quant_bias`` int32 [out]:
      x_q = clamp(round(x / input_scale + input_offset), -128, 127)
      y = (x_q @ w^T + quant_bias) * deq_scale                        (kernel kind w8a8_static_int8)
  msModelSlim writes deq_scale = input_scale * weight_scale and quant_bias =
  round(bias / deq_scale - input_offset * sum_k w[:, k]): the float ``bias`` (stored as FLOAT
  when the layer has one) is already inside quant_bias and is not added again (as vLLM-Ascend).

Torch-free (`tengyun plan` reads it): the safetensors headers say which tensors are stored, so
a description naming a tensor the weights lack is refused here, naming it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Mapping

from tengyun.quantization.config import QuantConfig, QuantGroup, QuantizationError
from tengyun.quantization.scheme import ACT, IN, OUT, LinearScheme, TensorLayout

METHOD = "ascend"
DESCRIPTION_FILE = "quant_model_description.json"
FLOAT = "FLOAT"
# metadata keys that switch on quantised attention or KV cache, which Tengyun does not run
UNSUPPORTED_METADATA = ("fa_quant_type", "kv_cache_type", "kv_quant_type")
SAFETENSORS_DTYPES = {"I8": "int8", "I32": "int32", "I64": "int64", "F32": "float32", "BF16": "bfloat16",
                      "F16": "float16"}

_WEIGHT = TensorLayout("weight", "int8", ((OUT, 1), (IN, 1)))
_PER_CHANNEL = (TensorLayout("weight_scale", ACT, ((OUT, 1), 1)),
                TensorLayout("weight_offset", ACT, ((OUT, 1), 1)))


def dynamic_scheme() -> LinearScheme:
    return LinearScheme(
        kernel="w8a8_int8", weight_bits=8, group_size=None, symmetric=True, tensors=(_WEIGHT, *_PER_CHANNEL),
        description="ModelSlim W8A8_DYNAMIC (int8 per-channel weights, dynamic per-token int8 activations)")


def static_scheme(deq_scale_dtype: str = "float32") -> LinearScheme:
    """``deq_scale_dtype``: "float32", or "int64" (float32 bits) as msModelSlim stores it for float16 models."""
    return LinearScheme(
        kernel="w8a8_static_int8", weight_bits=8, group_size=None, symmetric=True,
        tensors=(_WEIGHT, *_PER_CHANNEL,
                 TensorLayout("input_scale", ACT, (1,)), TensorLayout("input_offset", ACT, (1,)),
                 TensorLayout("deq_scale", deq_scale_dtype, ((OUT, 1),)),
                 TensorLayout("quant_bias", "int32", ((OUT, 1),))),
        description="ModelSlim W8A8 (int8 per-channel weights, static per-tensor int8 activations)")


SUPPORTED_TYPES = ("W8A8_DYNAMIC", "W8A8")


def from_folder(folder: Path | None) -> QuantConfig:
    """The model folder's quant_model_description.json -> QuantConfig (one group per scheme, its
    targets the module names). Raises QuantizationError naming the tensor or key."""
    path = Path(folder or ".") / DESCRIPTION_FILE
    if folder is None or not path.is_file():
        raise QuantizationError(f"--quantization ascend (msModelSlim) needs {DESCRIPTION_FILE} in the model "
                                f"folder, and {Path(folder or '.')} has none: drop --quantization for an "
                                f"unquantized checkpoint, or export the model with msModelSlim.")
    description = json.loads(path.read_text())
    if not isinstance(description, Mapping):
        raise QuantizationError(f"{path} is not a JSON object of tensor name -> quant type.")
    _check_metadata(description, path)
    modules = _quantized_modules(description, path)
    stored = stored_tensors(Path(folder))
    groups: dict[LinearScheme, list[str]] = {}
    for module, quant_type in modules.items():
        scheme = _scheme(quant_type, module, stored)
        if stored:
            _check_stored(module, quant_type, scheme, stored, path)
        groups.setdefault(scheme, []).append(module)
    return QuantConfig(METHOD, tuple(QuantGroup(tuple(names), scheme) for scheme, names in groups.items()))


def _check_metadata(description: Mapping[str, Any], path: Path) -> None:
    for key in UNSUPPORTED_METADATA:
        if description.get(key) not in (None, FLOAT):
            raise QuantizationError(f"{path.name} sets {key} {description[key]!r}: Tengyun does not run "
                                    f"quantised attention or KV cache; export with msModelSlim without it.")


def _quantized_modules(description: Mapping[str, Any], path: Path) -> dict[str, str]:
    """{module: quant type} for every ``<module>.weight`` not FLOAT; any other type refused."""
    modules = {}
    for name, quant_type in description.items():
        if "." not in name or quant_type == FLOAT:
            continue  # metadata ("model_quant_type", "version") or a float tensor
        if quant_type not in SUPPORTED_TYPES:
            raise QuantizationError(
                f"{path.name} says {name} is {quant_type!r}, which Tengyun does not run; it reads msModelSlim "
                f"{', '.join(SUPPORTED_TYPES)} and FLOAT (export with a W8A8 or W8A8_DYNAMIC recipe).")
        if name.endswith(".weight"):
            modules[name.removesuffix(".weight")] = quant_type
    return modules


def _scheme(quant_type: str, module: str, stored: Mapping[str, str]) -> LinearScheme:
    if quant_type == "W8A8_DYNAMIC":
        return dynamic_scheme()
    return static_scheme("int64" if stored.get(f"{module}.deq_scale") == "int64" else "float32")


def _check_stored(module: str, quant_type: str, scheme: LinearScheme, stored: Mapping[str, str], path: Path) -> None:
    names = ", ".join(t.name for t in scheme.tensors)
    for layout in scheme.tensors:
        name = f"{module}.{layout.name}"
        if name not in stored:
            raise QuantizationError(
                f"checkpoint tensor {name} is missing from {path.parent}: {path.name} says {module}.weight is "
                f"{quant_type}, which stores {names}; the description and the weights disagree (re-export it).")
    if stored[f"{module}.weight"] != "int8":
        raise QuantizationError(
            f"checkpoint tensor {module}.weight is {stored[f'{module}.weight']}, but {path.name} says it is "
            f"{quant_type}, which stores it as int8; the description and the weights disagree (re-export it).")


def stored_tensors(folder: Path) -> dict[str, str]:
    """{tensor name: dtype ("int8", "float32", ...)} over the folder's safetensors, from their
    JSON headers (8-byte little-endian length, then JSON); empty when there are none."""
    tensors: dict[str, str] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with open(shard, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        tensors.update({name: SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"])
                        for name, meta in header.items() if name != "__metadata__"})
    return tensors
