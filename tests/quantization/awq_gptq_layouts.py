"""AWQ GEMM and GPTQ checkpoints written from their published layouts, apart from Tengyun's
unpacking (numpy only), with an fp32 twin holding the exact dequantized weights.

AutoAWQ (WQLinear_GEMM.from_linear): qweight int32 [in, out / 8], word w's nibble j (bits 4j..)
holds output 8w + (0, 2, 4, 6, 1, 3, 5, 7)[j]; qzeros int32 [in / group, out / 8] the same;
scales fp16 [in / group, out]. AutoGPTQ (QuantLinear.pack): qweight int32 [in * bits / 32, out],
input i at bits bits * (i % pack) of word i // pack; qzeros int32 [groups, out * bits / 32], output
j at bits bits * (j % pack) of word j // pack, stored minus one in checkpoint_format "gptq" (v1);
scales fp16 [groups, out]; g_idx int32 [in]. Both: w = (q - z[g_idx]) * s[g_idx], unsigned q, z.
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_awq(values: np.ndarray) -> np.ndarray:
    """uint4 [rows, out] -> int32 [rows, out / 8] in AutoAWQ's order."""
    rows, out = values.shape
    v = values.astype(np.uint32).reshape(rows, out // 8, 8)
    words = np.zeros((rows, out // 8), dtype=np.uint32)
    for j, column in enumerate(AWQ_PACK_ORDER):
        words |= v[:, :, column] << np.uint32(4 * j)
    return words.view(np.int32)


def pack_gptq(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """unsigned ``bits``-bit values -> int32, 32 / bits of them per word along ``axis`` (qweight:
    axis 0, the inputs; qzeros: axis 1, the outputs), element k of a word at bits bits * k."""
    pack = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, 0)
    v = v.reshape(v.shape[0] // pack, pack, *v.shape[1:])
    words = np.zeros(v.shape[:1] + v.shape[2:], dtype=np.uint32)
    for k in range(pack):
        words |= v[:, k] << np.uint32(bits * k)
    return np.ascontiguousarray(np.moveaxis(words.view(np.int32), 0, axis))


@dataclass(frozen=True)
class Format:
    method: str  # "awq" or "gptq"
    bits: int = 4
    group: int = 32  # -1: one group (GPTQ)
    sym: bool = False
    desc_act: bool = False
    checkpoint_format: str = "gptq"  # GPTQ: "gptq" (v1, zeros minus one) or "gptq_v2"
    # GPTQModel's per-module `dynamic`: ((pattern, overrides), ...), "-:" left dense, "+:" overridden
    dynamic: tuple[tuple[str, dict], ...] = ()

    def for_module(self, module: str) -> "Format | None":
        """The format ``module`` is written in (the first matching dynamic pattern's); None: dense."""
        for pattern, overrides in self.dynamic:
            if re.match(pattern.removeprefix("-:").removeprefix("+:"), module):
                return None if pattern.startswith("-:") else replace(
                    self, bits=overrides.get("bits", self.bits), group=overrides.get("group_size", self.group),
                    sym=overrides.get("sym", self.sym), desc_act=overrides.get("desc_act", self.desc_act))
        return self

    def quantization_config(self) -> dict:
        if self.method == "awq":  # AutoAWQ's to_transformers_dict
            return {"quant_method": "awq", "bits": 4, "group_size": self.group, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": None}
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group, "desc_act": self.desc_act,
                "sym": self.sym, "checkpoint_format": self.checkpoint_format, "damp_percent": 0.01,
                "static_groups": False, "true_sequential": True, "lm_head": False,
                **({"dynamic": dict(self.dynamic)} if self.dynamic else {})}


def _input_key(module: str) -> str:
    """Modules GPTQ quantises from one input (one Hessian) share an act order: q/k/v, and gate/up."""
    prefix, _, proj = module.rpartition(".")
    return {"q_proj": f"{prefix}.qkv", "k_proj": f"{prefix}.qkv", "v_proj": f"{prefix}.qkv",
            "gate_proj": f"{prefix}.gate_up", "up_proj": f"{prefix}.gate_up"}.get(proj, module)


def _g_idx(fmt: Format, in_: int, seed: int) -> np.ndarray:
    groups_of = np.arange(in_) // (in_ if fmt.group == -1 else fmt.group)
    if not fmt.desc_act:
        return groups_of
    order = np.random.default_rng(seed).permutation(in_)  # act order: input order[k] is the k-th quantised
    g_idx = np.empty(in_, dtype=np.int64)
    g_idx[order] = groups_of
    return g_idx


def quantize_layer(fmt: Format, module: str, out: int, in_: int, rng) -> tuple[dict, torch.Tensor]:
    """Random stored values for one linear layer -> (its checkpoint tensors, dense fp32 [out, in])."""
    levels = 1 << fmt.bits
    groups = 1 if fmt.group == -1 else in_ // fmt.group
    q = rng.integers(0, levels, size=(in_, out))
    if fmt.sym:
        z = np.full((groups, out), levels // 2)
    else:  # v1 cannot store a zero of 0 (it would be -1)
        z = rng.integers(1 if fmt.checkpoint_format == "gptq" and fmt.method == "gptq" else 0, levels,
                         size=(groups, out))
    scale = (rng.uniform(0.03, 0.08, size=(groups, out)) * 16 / levels).astype(np.float16)
    g_idx = _g_idx(fmt, in_, seed=zlib.crc32(_input_key(module).encode()))
    dense = ((q - z[g_idx]) * scale.astype(np.float32)[g_idx]).astype(np.float32).T
    if fmt.method == "awq":
        stored = {"qweight": pack_awq(q), "qzeros": pack_awq(z), "scales": scale}
    else:
        v1 = fmt.checkpoint_format == "gptq"
        stored = {"qweight": pack_gptq(q, fmt.bits, 0), "qzeros": pack_gptq(z - v1, fmt.bits, 1), "scales": scale,
                  "g_idx": g_idx.astype(np.int32)}
    tensors = {f"{module}.{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in stored.items()}
    return tensors, torch.from_numpy(np.ascontiguousarray(dense))


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and name.startswith("model.layers.") and name.endswith("_proj.weight")


def write_checkpoint(source: Path, folder: Path, twin: Path, fmt: Format, seed: int = 0,
                     quantized=is_quantized) -> tuple[Path, Path]:
    """``source``'s tiny HF folder -> (``folder`` in ``fmt``, ``twin``: fp32, its dequantized weights).
    ``quantized(name, tensor)``: whether a tensor is a linear weight the format may quantise."""
    rng = np.random.default_rng(seed)
    stored, dense = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        module = name.removesuffix(".weight")
        written = fmt.for_module(module) if quantized(name, tensor) else None
        if written is None:
            stored[name] = dense[name] = tensor
            continue
        tensors, dense[name] = quantize_layer(written, module, *tensor.shape, rng)
        stored.update(tensors)
    config = json.loads((source / "config.json").read_text())
    for path, tensors, section in ((folder, stored, fmt.quantization_config()), (twin, dense, None)):
        path.mkdir(parents=True)
        save_file(tensors, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps({**config, "quantization_config": section} if section
                                                     else config))
        for f in source.iterdir():
            if f.suffix in (".json", ".txt") and f.name != "config.json":
                shutil.copy(f, path / f.name)
    return folder, twin
