"""GGUF kept quantised (quant_method "gguf", as vLLM's ``--quantization gguf``): the decoder's
linear weights stay in llama.cpp's blocks, and so do the embedding and LM head where their type
is one of these (model.embed_tokens / lm_head, rows by token: QuantConfig.vocab_layers,
tengyun/layers/embed_head.py); norms are dequantized once when the .gguf is converted
(tengyun/models/gguf_quantized.py).

A linear layer of ``out`` x ``in`` features holds one tensor, its GGUF rows unchanged:

    qweight uint8 [out, in / block, block bytes]     dims ((OUT, 1), (IN, block), bytes)
    Q8_0  block 32:  d fp16, 32 x int8 q                          w = d * q             (34 bytes)
    Q4_0  block 32:  d fp16, 16 bytes of nibbles                  w = d * (q - 8)       (18 bytes)
    Q4_1  block 32:  d fp16, m fp16, 16 bytes of nibbles          w = d * q + m         (20 bytes)
    Q4_K  block 256: d fp16, dmin fp16, 12 bytes of 6-bit scales
                     and mins for 8 sub-blocks of 32, 128 bytes
                     of nibbles                                   w = d * sc * q - dmin * mn (144 bytes)
    Q6_K  block 256: 128 bytes of low nibbles, 64 of high 2 bits,
                     16 int8 scales (one per 16), d fp16 last     w = d * sc * (q - 32)  (210 bytes)

Q5_0 (d fp16, 4 bytes of 5th bits, 16 of nibbles: w = d * (q - 16), 22 bytes) is stored as Q8_0,
losslessly (q - 16 fits an int8 under the same d), as is Q4_0 in a fused layer with Q8_0 or Q5_0.

(nibbles of Q4_0/Q4_1: byte j holds element j in its low half and j + 16 in its high half.)
Tensor parallelism splits whole blocks. config.json's section names each module's ggml type:

    {"quant_method": "gguf", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
     "tensor_types": {"model.layers.0.self_attn.q_proj": "Q4_1", ...}}

Torch-free: `tengyun plan` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from tengyun.quantization.config import QuantConfig, QuantGroup, QuantizationError
from tengyun.quantization.scheme import IN, OUT, LinearScheme, TensorLayout

METHOD = "gguf"


@dataclass(frozen=True)
class GgmlType:
    name: str  # "Q4_1", as gguf.GGMLQuantizationType names it
    block: int  # weights per block
    block_bytes: int
    bits: int
    symmetric: bool  # no offset term (m, dmin)
    scale_every: int = 32  # weights per scale: 32, or Q6_K's 16 (which torch's int4 matmul cannot take)


GGML_TYPES = {t.name: t for t in (
    GgmlType("Q8_0", 32, 34, 8, True),
    GgmlType("Q4_0", 32, 18, 4, True),
    GgmlType("Q4_1", 32, 20, 4, False),
    GgmlType("Q4_K", 256, 144, 4, False),
    GgmlType("Q6_K", 256, 210, 6, True, scale_every=16),
)}
SUPPORTED_TYPES = tuple(GGML_TYPES)
AS_Q8_0 = ("Q5_0",)  # read too, stored as Q8_0 (lossless)


def scheme_for_type(type_name: str) -> LinearScheme:
    """A ggml type kept quantised -> the LinearScheme its layers hold (kernel "gguf_q4_1", ...)."""
    ggml = GGML_TYPES[type_name]
    return LinearScheme(
        kernel=f"gguf_{ggml.name.lower()}", weight_bits=ggml.bits, group_size=ggml.scale_every,
        symmetric=ggml.symmetric,
        description=f"GGUF {ggml.name} ({ggml.bits}-bit blocks of {ggml.block}, kept quantised)",
        tensors=(TensorLayout("qweight", "uint8", ((OUT, 1), (IN, ggml.block), ggml.block_bytes)),))


def ggml_type_of(scheme: LinearScheme) -> GgmlType:
    return GGML_TYPES[scheme.kernel.removeprefix("gguf_").upper()]


def unsupported_type_message(tensor: str, type_name: str, dequantizable: bool) -> str:
    """The start-up error for a linear weight whose ggml type has no kernel here."""
    fix = ("drop --quantization gguf to load the .gguf dequantized to --dtype (the gguf package "
           f"dequantizes {type_name})" if dequantizable else
           f"re-quantize the model to one of them (llama-quantize), since the gguf package cannot dequantize "
           f"{type_name} either")
    return (f"{tensor} is stored as {type_name}, which Tengyun cannot keep quantised (--quantization gguf "
            f"keeps {', '.join(SUPPORTED_TYPES)}, and {', '.join(AS_Q8_0)} as Q8_0): {fix}.")


def quantization_config(gguf_file: str, tensor_types: Mapping[str, str]) -> dict[str, Any]:
    """config.json's section for a converted .gguf: {checkpoint module: ggml type name}."""
    return {"quant_method": METHOD, "gguf_file": gguf_file, "tensor_types": dict(sorted(tensor_types.items()))}


def from_config(quant: Mapping[str, Any], folder: Path | None = None) -> QuantConfig:
    """config.json's quantization_config -> one QuantGroup per ggml type, targeting its modules by name."""
    types = quant.get("tensor_types")
    if not isinstance(types, Mapping) or not types:
        raise QuantizationError(
            "--quantization gguf reads a .gguf file: pass the .gguf as --model (Tengyun converts it once, "
            "keeping its quantised blocks); this folder's config.json has no quantization_config.tensor_types.")
    by_type: dict[str, list[str]] = {}
    for module, type_name in types.items():
        if type_name not in GGML_TYPES:
            raise QuantizationError(unsupported_type_message(module, str(type_name), dequantizable=True))
        by_type.setdefault(type_name, []).append(module)
    return QuantConfig(METHOD, tuple(QuantGroup(tuple(modules), scheme_for_type(type_name))
                                     for type_name, modules in sorted(by_type.items())), vocab_layers=True,
                       mixed_shards=True)
