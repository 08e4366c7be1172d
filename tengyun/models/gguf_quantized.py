"""A .gguf converted keeping its quantised blocks (`--quantization gguf`; tengyun/quantization/gguf.py).

The converted folder is today's (model_source.convert_gguf: transformers maps GGUF names onto HF
names and dequantizes) with each decoder linear weight replaced by its raw GGUF rows:

    model.layers.0.self_attn.q_proj.weight  float32 [576, 576]
 -> model.layers.0.self_attn.q_proj.qweight uint8 [576, 18, 20]   (Q4_1: 18 blocks of 20 bytes per row)

in the row order transformers gives the dense weight (Llama's q/k rows un-permuted, found by
running transformers' own tensor processor on the row numbers), and checked to dequantize to
exactly that dense weight. MoE experts (Qwen3-MoE's blk.N.ffn_{gate,up,down}_exps, [E, rows,
blocks]) are split per expert, as the loader reads any MoE checkpoint:

    model.layers.0.mlp.experts.gate_up_proj   float32 [E, 2I, H]
 -> model.layers.0.mlp.experts.{e}.gate_proj.qweight, .up_proj.qweight  uint8 [I, H / block, bytes]

and config.json names them by expert 0 (every expert of a layer shares its .gguf tensor's type;
gate and up one, down may differ: llama.cpp's Q4_K_M stores some down_exps as Q6_K). The
embedding (token_embd) and LM head (output) keep their blocks too where their type is one Tengyun
keeps (model.embed_tokens.qweight, lm_head.qweight; a tied model stores only the embedding's),
else stay dense; norms stay dequantized (float32).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import torch

from tengyun.layers.gguf_kernels import dequantize_blocks, q4_0_as_q8_0, q5_0_as_q8_0
from tengyun.quantization.config import QuantizationError
from tengyun.quantization.gguf import AS_Q8_0, SUPPORTED_TYPES, quantization_config, unsupported_type_message

logger = logging.getLogger(__name__)

DENSE_TYPES = ("F32", "F16", "BF16")  # linear weights of these types load as dense layers
_LINEAR = re.compile(r"^blk\.(\d+)\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down"
                     r"|ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.weight$")
# Tengyun runs each group as one layer (the experts' gate and up as one stack: FusedMoE's w13)
_FUSED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"), ("ffn_gate_exps", "ffn_up_exps"))
_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_VOCAB = ("token_embd.weight", "output.weight")  # kept when their type is, else dense: never refused
_AS_Q8_0 = {"Q5_0": q5_0_as_q8_0, "Q4_0": q4_0_as_q8_0}  # file type -> its blocks re-encoded as Q8_0 (lossless)


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


def kept_types(gguf_file: Path) -> dict[str, str]:
    """{GGUF name: the ggml type Tengyun stores} of every decoder linear weight kept quantised
    (Q5_0 as Q8_0, and Q4_0 too in a fused layer with Q8_0: lossless). A fused layer (q/k/v,
    gate/up) still mixing types (llama.cpp's Q4_K_M: Q6_K attn_v beside Q4_K q and k) keeps each
    type: its modules run as shards (LinearBase.use_shard_schemes). MoE experts' gate and up mixing
    types are left out (FusedMoE stacks them as one tensor): they load dense (dequantized to
    --dtype). A log line names both kinds. Refuses, before converting, an unsupported type."""
    import gguf

    types: dict[str, str] = {}
    for tensor in gguf.GGUFReader(str(gguf_file)).tensors:
        type_name = tensor.tensor_type.name
        if tensor.name in _VOCAB and (type_name in SUPPORTED_TYPES or type_name in AS_Q8_0):
            types[tensor.name] = "Q8_0" if type_name in AS_Q8_0 else type_name
        elif _LINEAR.match(tensor.name) and type_name not in DENSE_TYPES:
            if type_name not in SUPPORTED_TYPES and type_name not in AS_Q8_0:
                raise QuantizationError(unsupported_type_message(tensor.name, type_name, gguf_dequantizable(type_name)))
            types[tensor.name] = "Q8_0" if type_name in AS_Q8_0 else type_name
    mixed: dict[str, list[str]] = {"dense": [], "shards": []}  # how each fused layer mixing types loads
    for name in [n for n in types if n not in _VOCAB]:
        block, kind = _LINEAR.match(name).groups()
        fused = next((g for g in _FUSED if kind in g), (kind,))
        shown = {n: types.get(n) for n in [f"blk.{block}.{k}.weight" for k in fused]}
        if len(set(shown.values())) > 1 and set(shown.values()) <= {"Q8_0", "Q4_0"}:
            types.update({n: "Q8_0" for n in shown})
        elif len(set(shown.values())) > 1 and name in types:
            listed = ", ".join(f"{n} {t or 'dense'}" for n, t in shown.items())
            kind_of = "dense" if fused == _FUSED[2] else "shards"
            if listed not in mixed[kind_of]:  # once per layer, not per module
                mixed[kind_of].append(listed)
            if fused == _FUSED[2]:  # FusedMoE stacks gate and up as one tensor of one type
                for n in shown:
                    types.pop(n, None)
    _log_mixed(gguf_file, mixed)
    return types


def _log_mixed(gguf_file: Path, mixed: dict[str, list[str]]) -> None:
    if mixed["shards"]:
        logger.info("%s: %d fused layer(s) mix ggml types (llama.cpp's Q4_K_M does); each module runs with its "
                    "own type: %s", gguf_file.name, len(mixed["shards"]), "; ".join(mixed["shards"][:3]))
    if mixed["dense"]:
        logger.info("%s: %d MoE layer(s) store experts' gate and up in different ggml types and load dense "
                    "(dequantized to --dtype), as Tengyun stacks them as one tensor: %s", gguf_file.name,
                    len(mixed["dense"]), "; ".join(mixed["dense"][:3]))


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
    stored = kept_types(gguf_file)
    architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed.get("config", {}))
    key_map = get_gguf_hf_weights_map(skeleton, processor)
    kept: dict[str, str] = {}
    for tensor in reader.tensors:
        if tensor.name not in stored:
            continue
        if _EXPERTS.match(tensor.name):
            kept.update(_keep_experts(tensor, stored[tensor.name], key_map, tensors))
            continue
        if key_map.get(tensor.name) not in tensors:  # a tied model's output: unused
            continue
        hf_name, type_name = key_map[tensor.name], stored[tensor.name]
        blocks = _stored_blocks(tensor, type_name)
        blocks = blocks[_row_order(processor, tensor.name, blocks.shape[0], parsed, key_map)].contiguous()
        _check_blocks(tensor.name, type_name, blocks, tensors[hf_name])
        del tensors[hf_name]
        module = hf_name.removesuffix(".weight")
        tensors[f"{module}.qweight"] = blocks
        kept[module] = type_name
    if not kept.keys() - {"model.embed_tokens", "lm_head"}:
        raise QuantizationError(f"{gguf_file} holds no decoder linear weight in {', '.join(SUPPORTED_TYPES)}: "
                                f"drop --quantization gguf, it loads dequantized to --dtype.")
    return quantization_config(gguf_file.name, kept)


def _stored_blocks(tensor, type_name: str) -> torch.Tensor:
    """A .gguf tensor's blocks as Tengyun stores them: uint8 [(E,) rows, blocks, block bytes], Q5_0
    (and Q4_0 fused with Q8_0) re-encoded as Q8_0."""
    from gguf import GGML_QUANT_SIZES

    data = torch.from_numpy(np.array(tensor.data))
    blocks = data.reshape(*data.shape[:-1], -1, GGML_QUANT_SIZES[tensor.tensor_type][1])
    return _AS_Q8_0.get(tensor.tensor_type.name, lambda b: b)(blocks) if type_name == "Q8_0" else blocks


def _check_blocks(gguf_name: str, type_name: str, blocks: torch.Tensor, dense: torch.Tensor) -> None:
    if not torch.equal(dequantize_blocks(blocks, type_name), dense):
        raise QuantizationError(f"{gguf_name} ({type_name}): its kept blocks do not dequantize to what "
                                f"transformers reads; drop --quantization gguf to load the .gguf dequantized.")


def _keep_experts(tensor, type_name: str, key_map: dict, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """blk.N.ffn_{gate,up,down}_exps [E, rows, blocks, bytes] -> per-expert ``qweight`` entries of
    ``tensors``, in place of transformers' stacked experts.gate_up_proj [E, 2I, H] (gate rows, then
    up) / experts.down_proj [E, H, I]; checked to dequantize to them. -> {expert 0's module: type}."""
    layer, proj = _EXPERTS.match(tensor.name).groups()
    hf_name = key_map[tensor.name.removesuffix(".weight")]  # ...mlp.experts.gate_up_proj / down_proj
    blocks = _stored_blocks(tensor, type_name)
    dense = tensors[hf_name]
    if proj != "down":
        half = dense.shape[1] // 2
        dense = dense.narrow(1, 0 if proj == "gate" else half, half)
    for expert in range(blocks.shape[0]):
        _check_blocks(f"{tensor.name} (expert {expert})", type_name, blocks[expert], dense[expert])
    prefix = hf_name.rpartition(".")[0]  # model.layers.N.mlp.experts
    for expert in range(blocks.shape[0]):
        tensors[f"{prefix}.{expert}.{proj}_proj.qweight"] = blocks[expert].clone()
    if proj == "down" or f"{prefix}.0.gate_proj.qweight" in tensors and f"{prefix}.0.up_proj.qweight" in tensors:
        del tensors[hf_name]  # gate_up_proj goes once both halves are kept (kept_types keeps both or neither)
    return {f"{prefix}.0.{proj}_proj": type_name}
