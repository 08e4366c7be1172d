"""A .gguf converted keeping its quantised blocks (`--quantization gguf`; tengyun/quantization/gguf.py).

The converted folder is today's (model_source.convert_gguf: transformers maps GGUF names onto HF
names and dequantizes) with each decoder linear weight replaced by its raw GGUF rows:

    model.layers.0.self_attn.q_proj.weight  float32 [576, 576]
 -> model.layers.0.self_attn.q_proj.qweight uint8 [576, 18, 20]   (Q4_1: 18 blocks of 20 bytes per row)

in the row order transformers gives the dense weight (Llama's q/k rows un-permuted, found by
running transformers' own tensor processor on the row numbers), and checked to dequantize to
exactly that dense weight. Norms, embeddings and lm_head stay dequantized (float32).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from tengyun.layers.gguf_kernels import dequantize_blocks
from tengyun.quantization.config import QuantizationError
from tengyun.quantization.gguf import GGML_TYPES, SUPPORTED_TYPES, quantization_config, unsupported_type_message

DENSE_TYPES = ("F32", "F16", "BF16")  # linear weights of these types load as dense layers
_LINEAR = re.compile(r"^blk\.(\d+)\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")
_FUSED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))  # Tengyun runs each group as one layer


def gguf_dequantizable(type_name: str) -> bool:
    """Can the gguf package dequantize ``type_name`` (so `--quantization` left off loads it)?"""
    import gguf
    from gguf.quants import dequantize

    qtype = gguf.GGMLQuantizationType[type_name]
    try:
        dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def check_kept_types(gguf_file: Path) -> None:
    """Refuse, before converting (keep_blocks), a .gguf whose decoder linear weights Tengyun cannot keep: an
    unsupported ggml type, MoE experts, or one fused layer (q/k/v, gate/up) mixing types."""
    import gguf

    types: dict[str, str] = {}
    for tensor in gguf.GGUFReader(str(gguf_file)).tensors:
        type_name = tensor.tensor_type.name
        if "_exps." in tensor.name:
            raise QuantizationError(f"{tensor.name}: --quantization gguf keeps dense models' blocks, not MoE "
                                    f"experts; drop --quantization gguf to load the .gguf dequantized.")
        if _LINEAR.match(tensor.name):
            if type_name not in SUPPORTED_TYPES and type_name not in DENSE_TYPES:
                raise QuantizationError(unsupported_type_message(tensor.name, type_name, gguf_dequantizable(type_name)))
            types[tensor.name] = type_name
    for name in types:
        block, kind = _LINEAR.match(name).groups()
        group = next((g for g in _FUSED if kind in g), (kind,))
        mixed = {f"blk.{block}.{k}.weight": types.get(f"blk.{block}.{k}.weight") for k in group}
        if len(set(mixed.values())) > 1:
            shown = ", ".join(f"{n} {t}" for n, t in mixed.items())
            raise QuantizationError(f"{shown}: Tengyun runs these as one layer, which holds one ggml type; drop "
                                    f"--quantization gguf to load the .gguf dequantized to --dtype.")


def _row_order(processor, gguf_name: str, rows: int, parsed: dict, key_map: dict) -> torch.Tensor:
    """The row permutation transformers' processor applies to this tensor (identity for most)."""
    probe = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    result = processor.process(weights=probe, name=gguf_name, tensor_key_mapping=key_map, parsed_parameters=parsed)
    order = np.asarray(result.weights).reshape(-1)
    if order.shape != (rows,) or not np.array_equal(np.sort(order), np.arange(rows)):
        raise QuantizationError(f"{gguf_name}: transformers reshapes this tensor beyond reordering its rows, so "
                                f"its blocks cannot be kept; drop --quantization gguf to load the .gguf dequantized.")
    return torch.from_numpy(order.astype(np.int64))


def keep_blocks(gguf_file: Path, parsed: dict, skeleton, tensors: dict[str, torch.Tensor]) -> dict:
    """``tensors`` (HF name -> dequantized float32, from transformers' load_gguf_checkpoint on the
    ``skeleton``) with each quantised decoder linear weight swapped for its ``qweight`` blocks.
    -> config.json's quantization_config. Raises QuantizationError naming the tensor."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    reader = gguf.GGUFReader(str(gguf_file))
    architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed.get("config", {}))
    key_map = get_gguf_hf_weights_map(skeleton, processor)
    kept: dict[str, str] = {}
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if not _LINEAR.match(tensor.name) or type_name not in GGML_TYPES:
            continue
        hf_name = key_map[tensor.name]
        rows = int(tensor.data.shape[0])
        blocks = torch.from_numpy(np.array(tensor.data)).reshape(rows, -1, GGML_TYPES[type_name].block_bytes)
        blocks = blocks[_row_order(processor, tensor.name, rows, parsed, key_map)].contiguous()
        if not torch.equal(dequantize_blocks(blocks, type_name), tensors[hf_name]):
            raise QuantizationError(f"{tensor.name} ({type_name}): its kept blocks do not dequantize to what "
                                    f"transformers reads; drop --quantization gguf to load the .gguf dequantized.")
        del tensors[hf_name]
        module = hf_name.removesuffix(".weight")
        tensors[f"{module}.qweight"] = blocks
        kept[module] = type_name
    if not kept:
        raise QuantizationError(f"{gguf_file} holds no decoder linear weight in {', '.join(SUPPORTED_TYPES)}: "
                                f"drop --quantization gguf, it loads dequantized to --dtype.")
    return quantization_config(gguf_file.name, kept)
