"""Write a tiny HF checkpoint (tests/conftest.py) as a .gguf the way llama.cpp's converter lays
it out: llama.cpp tensor names, its metadata keys, the byte-level BPE tokenizer as
tokenizer.ggml.* (vocab, merges), each weight in the ggml type asked for, quantised by the gguf
package's own quantize. transformers and Tengyun then read the file as they read a downloaded
one; the dequantized twin (the same HF folder holding the gguf package's dequantized values) is
what HF runs as the reference.

Covers the Qwen3-MoE names (qwen3moe: ffn_gate_inp, ffn_{gate,up,down}_exps [E, rows, cols]) and
the dense Qwen3 ones; Qwen and not Llama, so no q/k row permutation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import gguf
from gguf.quants import dequantize, quantize

_LAYER = {  # HF suffix after model.layers.N. -> llama.cpp name after blk.N.
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_EXPERT_PROJ = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
ARCH = {"qwen3_moe": "qwen3moe", "qwen3": "qwen3"}


def _gguf_tensors(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, np.ndarray]:
    """HF names -> llama.cpp names; per-expert projections stacked [E, rows, cols]."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, list] = {}
    for name, tensor in tensors.items():
        if name in _TOP:
            out[_TOP[name]] = tensor.float().numpy()
            continue
        _, _, layer, rest = name.split(".", 3)
        if ".experts." in rest:  # mlp.experts.E.gate_proj.weight
            _, _, expert, proj, _ = rest.split(".")
            experts.setdefault(f"blk.{layer}.{_EXPERT_PROJ[proj]}.weight", [None] * num_experts)[int(expert)] = tensor
            continue
        out[f"blk.{layer}.{_LAYER[rest]}"] = tensor.float().numpy()
    for name, stack in experts.items():
        out[name] = torch.stack(stack).float().numpy()
    return out


def _per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as per-expert tensors."""
    out = {}
    for name, tensor in tensors.items():
        prefix, sep, leaf = name.rpartition(".experts.")
        if sep and leaf == "gate_up_proj":
            for e, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1))):
                out[f"{prefix}.experts.{e}.gate_proj.weight"], out[f"{prefix}.experts.{e}.up_proj.weight"] = gate, up
        elif sep and leaf == "down_proj":
            out.update({f"{prefix}.experts.{e}.down_proj.weight": t for e, t in enumerate(tensor)})
        else:
            out[name] = tensor
    return out


def _add_tokenizer(writer, folder: Path, vocab_size: int) -> None:
    """The tokenizer, its list padded to the embedding's rows with [PADi] as llama.cpp's converter does."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(tokenizer["model"]["vocab"])
    for added in tokenizer.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    for text, token_id in vocab.items():
        tokens[token_id] = text
    special = {a["id"] for a in tokenizer.get("added_tokens", [])}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    # ggml token types: 3 control, 1 normal, 5 unused (the padding)
    writer.add_token_types([3 if i in special else 1 if i < len(vocab) else 5 for i in range(vocab_size)])
    writer.add_token_merges(merges)
    eos = next(a["id"] for a in tokenizer["added_tokens"] if a["content"] == "<|endoftext|>")
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(eos)
    writer.add_add_bos_token(False)
    template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    if template:
        writer.add_chat_template(template)


def write_gguf(folder: Path, out: Path, types: dict[str, str], twin: Path | None = None) -> Path:
    """The HF checkpoint ``folder`` -> the .gguf ``out``; ``types``: llama.cpp tensor name (or its
    part after blk.N., e.g. "ffn_down_exps.weight") -> ggml type, F32 when absent (norms and the
    router always are). ``twin``: also write the HF folder holding the dequantized values there."""
    config = json.loads((folder / "config.json").read_text())
    arch = ARCH[config["model_type"]]
    num_experts = config.get("num_experts") or config.get("num_local_experts") or 0
    hf = _per_expert(load_file(folder / "model.safetensors"))
    tensors = _gguf_tensors(hf, num_experts)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(out.stem)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta", 1e6))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    _add_tokenizer(writer, folder, config["vocab_size"])
    dequantized: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        type_name = types.get(name) or types.get(name.split(".", 2)[-1] if name.startswith("blk.") else name, "F32")
        if type_name == "F32":
            writer.add_tensor(name, array.astype(np.float32))
            dequantized[name] = array
            continue
        qtype = gguf.GGMLQuantizationType[type_name]
        blocks = quantize(array.astype(np.float32), qtype)
        writer.add_tensor(name, blocks, raw_dtype=qtype)
        dequantized[name] = dequantize(blocks, qtype).reshape(array.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if twin is not None:
        _write_twin(folder, twin, hf, dequantized)
    return out


def _write_twin(folder: Path, twin: Path, hf: dict, dequantized: dict) -> None:
    """``folder`` with every weight replaced by its dequantized .gguf value (per-expert names)."""
    values = {}
    for name in hf:
        if name in _TOP:
            values[name] = dequantized[_TOP[name]]
            continue
        _, _, layer, rest = name.split(".", 3)
        if ".experts." in rest:
            _, _, expert, proj, _ = rest.split(".")
            values[name] = dequantized[f"blk.{layer}.{_EXPERT_PROJ[proj]}.weight"][int(expert)]
        else:
            values[name] = dequantized[f"blk.{layer}.{_LAYER[rest]}"]
    shutil.copytree(folder, twin)
    save_file({k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in values.items()},
              str(twin / "model.safetensors"))


def requantize(src: Path, out: Path, types: dict[str, str]) -> Path:
    """A copy of the .gguf ``src`` (every metadata key, every other tensor's bytes) with the
    tensors whose name ends in a key of ``types`` (e.g. "attn_v.weight") dequantized and
    quantised again by the gguf package as that type: a real model with a Q4_K_M-like mix."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, sub_type)
    for tensor in reader.tensors:  # data: [rows, row bytes] uint8 when quantised, else [rows, cols]
        target = next((t for suffix, t in types.items() if tensor.name.endswith(suffix)), None)
        if target is None:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        values = dequantize(np.array(tensor.data), tensor.tensor_type)
        qtype = gguf.GGMLQuantizationType[target]
        writer.add_tensor(tensor.name, quantize(values.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
