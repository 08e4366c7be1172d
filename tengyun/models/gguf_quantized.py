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

import collections
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from tengyun.layers.gguf_kernels import dequantize_blocks, q4_0_as_q8_0, q5_0_as_q8_0
from tengyun.models.gguf_reader import gguf_reader
from tengyun.quantization.config import QuantizationError
from tengyun.quantization.gguf import AS_Q8_0, SUPPORTED_TYPES, quantization_config, unsupported_type_message

logger = logging.getLogger(__name__)

DENSE_TYPES = ("F32", "F16", "BF16")  # linear weights of these types load as dense layers
_LINEAR = re.compile(r"^blk\.(\d+)\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down"
                     r"|ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.weight$")
# Tengyun runs each group as one layer (the experts' gate and up as one stack: FusedMoE's w13)
_FUSED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"), ("ffn_gate_exps", "ffn_up_exps"))
_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_KEPT_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.(gate|up|down)_proj\.qweight$")
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
    types: dict[str, str] = {}
    for tensor in gguf_reader(gguf_file).tensors:
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


def _reading(gguf_file: Path, parsed: dict, skeleton, keep: bool):
    """(the file's reader, kept_types (keep) or {}, transformers' tensor processor and GGUF -> HF
    name map)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    reader = gguf_reader(gguf_file)
    architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed.get("config", {}))
    return reader, kept_types(gguf_file) if keep else {}, processor, get_gguf_hf_weights_map(skeleton, processor)


def _keep(tensor, type_name: str, hf_name: str, mapping: tuple, kept: dict) -> tuple[str, torch.Tensor]:
    """(module.qweight, the .gguf tensor's blocks in transformers' row order), checked a chunk of rows
    at a time to dequantize to what transformers reads for ``hf_name``; kept[module] = its type."""
    processor, parsed, key_map = mapping
    blocks = _stored_blocks(np.asarray(tensor.data), tensor.tensor_type, type_name)
    order = _row_order(processor, tensor.name, blocks.shape[0], parsed, key_map)
    blocks = blocks[order].contiguous()
    _check_rows(tensor, type_name, blocks, order)
    module = hf_name.removesuffix(".weight")
    kept[module] = type_name
    return f"{module}.qweight", blocks


def kept_section(gguf_file: Path, kept: dict[str, str]) -> dict:
    """config.json's quantization_config for the modules ``kept`` (module -> ggml type); refuses a
    file none of whose decoder linear weights was kept."""
    if not kept.keys() - {"model.embed_tokens", "lm_head"}:
        raise QuantizationError(f"{gguf_file} holds no decoder linear weight in {', '.join(SUPPORTED_TYPES)}: "
                                f"drop --quantization gguf, it loads dequantized to --dtype.")
    return quantization_config(gguf_file.name, kept)


def stream_tensors(gguf_file: Path, parsed: dict, skeleton, kept: dict[str, str] | None,
                   stored: dict[str, str] | None = None) -> Iterator[tuple]:
    """A .gguf tensor by tensor, as transformers' load_gguf_checkpoint reads it (dequantized to
    float32, its processor's names and row order; MoE experts' gate and up merged into one
    experts.gate_up_proj [E, 2I, H] stack) -> (HF name, tensor) pairs, one tensor (or one layer's
    expert stack) held at a time: never the whole model's float32 (~4 bytes a parameter).
    ``parsed``: load_gguf_checkpoint's result without tensors. ``kept`` a dict (kept quantised):
    the decoder's linear weights come as their blocks (``module.qweight``, experts one per expert:
    ``...mlp.experts.{e}.gate_proj.qweight``), each checked to dequantize to the gguf package's
    dequantization a chunk of rows (or an expert) at a time, and ``kept`` gets module -> ggml type
    as they are read. ``stored``: kept_types(gguf_file) when the caller has it already."""
    keep = kept is not None
    reader, found, processor, key_map = _reading(gguf_file, parsed, skeleton, keep=keep and stored is None)
    types = (found if stored is None else stored) if keep else {}
    mapping = (processor, parsed, key_map)
    stacks = _ExpertStacks(reader, parsed, key_map)
    for tensor in reader.tensors:  # as load_gguf_checkpoint's loop, kept blocks never dequantized whole
        if tensor.name not in types:
            yield from stacks.read(tensor, processor, key_map)
        elif _EXPERTS.match(tensor.name):
            yield from _keep_experts(tensor, types[tensor.name], key_map, kept)
        elif tensor.name in key_map:  # else a tied model's output: unused
            yield _keep(tensor, types[tensor.name], key_map[tensor.name], mapping, kept)


class _ExpertStacks:
    """Dequantized tensors as load_gguf_checkpoint gives them. transformers' MoE processor writes a
    layer's experts into one stack of its ``parsed_parameters["tensors"]`` (gate rows, then up, in
    experts.gate_up_proj [E, 2I, H]; down alone in experts.down_proj) instead of returning them:
    each stack is held here until every .gguf tensor mapped onto it was read."""

    def __init__(self, reader, parsed: dict, key_map: dict) -> None:
        self.parts = collections.Counter(key_map.get(t.name.removesuffix(".weight")) for t in reader.tensors
                                         if _EXPERTS.match(t.name))
        self.parsed = {**parsed, "tensors": {}}  # what the processor reads, and where it stacks

    def read(self, tensor, processor, key_map: dict) -> Iterator[tuple]:
        from gguf.quants import dequantize

        result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                   tensor_key_mapping=key_map, parsed_parameters=self.parsed)
        if result.name is not None:  # returned, not stacked
            if result.name in key_map:
                yield key_map[result.name], _owned(result.weights).float()
            return
        hf_name = key_map.get(tensor.name.removesuffix(".weight"))
        if hf_name is None or hf_name not in self.parts:  # dropped, as load_gguf_checkpoint drops it
            return
        self.parts[hf_name] -= 1
        if self.parts[hf_name] == 0:
            yield hf_name, self.parsed["tensors"].pop(hf_name).float()


def skeleton_name(name: str) -> str:
    """The skeleton's parameter a streamed tensor stands for: a kept ``module.qweight`` for
    ``module.weight``, a kept expert's for its layer's experts.gate_up_proj / down_proj."""
    expert = _KEPT_EXPERT.match(name)
    if expert:
        return f"{expert.group(1)}.{'down_proj' if expert.group(2) == 'down' else 'gate_up_proj'}"
    return name.replace(".qweight", ".weight")


def _owned(array: np.ndarray) -> torch.Tensor:
    """A tensor over ``array``'s memory when it is writable and contiguous (dequantizing gives a
    fresh array, often a reshaped view of its own temporary: copying it doubled the largest
    tensor at the peak, +520 MiB converting Qwen2.5-Coder dequantized), else over a copy (an F32
    tensor can come as a read-only view of the file)."""
    if not (array.flags.writeable and array.flags.c_contiguous):
        array = np.copy(array)
    return torch.from_numpy(array)


def _stored_blocks(data: np.ndarray, qtype, type_name: str) -> torch.Tensor:
    """A .gguf tensor's raw data (uint8 [rows, row bytes]) as Tengyun stores its blocks: uint8 [rows,
    blocks, block bytes], Q5_0 (and Q4_0 fused with Q8_0) re-encoded as Q8_0."""
    from gguf import GGML_QUANT_SIZES

    data = torch.from_numpy(np.array(data))
    blocks = data.reshape(*data.shape[:-1], -1, GGML_QUANT_SIZES[qtype][1])
    as_q8_0 = _AS_Q8_0.get(qtype.name) if type_name == "Q8_0" else None
    if as_q8_0 is None:
        return blocks
    # re-encoded 2048 rows at a time: the re-encoding's integer temporaries stay small (a whole
    # 151936-row Q5_0 embedding took 4.3 GB at once)
    return torch.cat([as_q8_0(part) for part in blocks.split(2048)])


def _check_blocks(gguf_name: str, type_name: str, blocks: torch.Tensor, dense: torch.Tensor) -> None:
    if not torch.equal(dequantize_blocks(blocks, type_name), dense):
        raise QuantizationError(f"{gguf_name} ({type_name}): its kept blocks do not dequantize to what "
                                f"transformers reads; drop --quantization gguf to load the .gguf dequantized.")


def _check_rows(tensor, type_name: str, blocks: torch.Tensor, order: torch.Tensor, rows: int = 2048) -> None:
    """As _check_blocks against transformers' dense weight, which is the gguf package's
    dequantization with its rows in ``order`` (_row_order checked that the processor only reorders
    them), but ``rows`` rows at a time: never the whole tensor in float32."""
    from gguf.quants import dequantize

    data = np.asarray(tensor.data)
    for start in range(0, blocks.shape[0], rows):
        picked = order[start:start + rows].numpy()
        dense = torch.from_numpy(dequantize(data[picked], tensor.tensor_type)).float()
        _check_blocks(f"{tensor.name} (rows {start}+)", type_name, blocks[start:start + rows], dense)


def _keep_experts(tensor, type_name: str, key_map: dict, kept: dict) -> Iterator[tuple]:
    """blk.N.ffn_{gate,up,down}_exps [E, rows, row bytes] -> (per-expert ``qweight`` name, blocks)
    pairs, in place of transformers' stacked experts.gate_up_proj [E, 2I, H] (gate rows, then up) /
    experts.down_proj [E, H, I], each expert checked to dequantize to the gguf package's
    dequantization of its rows (what transformers' processor stacks: it does not reorder them);
    kept gets expert 0's module -> type (every expert of a stack shares its type)."""
    from gguf.quants import dequantize

    proj = _EXPERTS.match(tensor.name).group(2)
    prefix = key_map[tensor.name.removesuffix(".weight")].rpartition(".")[0]  # model.layers.N.mlp.experts
    kept[f"{prefix}.0.{proj}_proj"] = type_name
    data = np.asarray(tensor.data)
    for expert in range(data.shape[0]):
        blocks = _stored_blocks(data[expert], tensor.tensor_type, type_name)
        dense = torch.from_numpy(dequantize(data[expert], tensor.tensor_type)).float()
        _check_blocks(f"{tensor.name} (expert {expert})", type_name, blocks, dense)
        yield f"{prefix}.{expert}.{proj}_proj.qweight", blocks
