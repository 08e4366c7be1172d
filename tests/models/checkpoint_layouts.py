"""Tiny checkpoints in the layouts the published Qwen3.5 / Qwen3.5-MoE / Qwen3-Next folders hold,
scaled down from their config.json (tests/fixtures/ops/qwen3_5_397b_a17b), not only what
save_pretrained of a text config writes:

- the multimodal wrapper (Qwen3_5[Moe]ForConditionalGeneration): config.json with text_config and
  vision_config, text weights under model.language_model.*, a vision tower under model.visual.*;
- MTP layers (mtp.fc, mtp.pre_fc_norm_*, mtp.layers.0.* shaped as a full-attention decoder layer);
- experts fused (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]: the bf16 releases)
  or per expert (experts.N.gate_proj.weight ...: save_pretrained, the FP8 releases, Qwen3-Next);
- tied (lm_head absent) or untied heads;
- FP8 block quantization as Qwen/Qwen3.5-*-FP8: float8_e4m3fn weights with bf16 *_scale_inv tiles,
  quantization_config at the wrapper's top level; norms, embeddings, head, routers, the shared
  expert's gate and the Gated DeltaNet's conv / A_log / dt_bias / in_proj_a / in_proj_b stay as is.
  The tile is [16, 32] (the releases: [128, 128]) so the tiny shapes span several tiles, some
  partial, and a rows / columns mix-up shows.

Sharded in two files with model.safetensors.index.json, as the releases are; layer 0's FP8 scales
sit in the other shard from their weights. ``write_layout`` returns the folder HF transformers
loads as the reference: the checkpoint itself (HF reads every non-FP8 layout here), or for FP8 its
dequantized float32 twin.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from conftest import QWEN3_5_MOE, QWEN3_5_TEXT, QWEN3_NEXT, randomize_norms_and_routers

VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
NEXT = QWEN3_NEXT
FP8_BLOCK = [16, 32]
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
# 2-D weights the FP8 releases quantize (by the module's last name).
_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_qkvz", "in_proj_z", "out_proj",
              "gate_proj", "up_proj", "down_proj", "gate_up_proj", "fc")


@dataclass(frozen=True)
class Layout:
    family: str  # "qwen3_5" | "qwen3_5_moe" (multimodal wrappers) | "qwen3_next" (text only)
    experts: str = "per_expert"  # "per_expert" | "fused" (MoE families)
    tied: bool = False
    fp8: bool = False


LAYOUTS = {
    "qwen3_5-wrapper": Layout("qwen3_5"),
    "qwen3_5-wrapper-tied": Layout("qwen3_5", tied=True),
    "qwen3_5_moe-wrapper-fused": Layout("qwen3_5_moe", experts="fused"),
    "qwen3_5_moe-wrapper-per-expert": Layout("qwen3_5_moe"),
    "qwen3_5_moe-wrapper-fp8": Layout("qwen3_5_moe", fp8=True),
    "qwen3_next-fp8": Layout("qwen3_next", fp8=True),
}


def hf_model(layout: Layout, seed: int = 0):
    """The tiny random HF model of ``layout``'s family (fp32, eval), its head tied or not."""
    import transformers

    torch.manual_seed(seed)
    tied = dict(tie_word_embeddings=layout.tied)
    if layout.family == "qwen3_next":
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**NEXT, **tied))
    elif layout.family == "qwen3_5":
        config = transformers.Qwen3_5Config(text_config=dict(QWEN3_5_TEXT, **tied), vision_config=VISION, **tied)
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    else:
        config = transformers.Qwen3_5MoeConfig(text_config=dict(QWEN3_5_TEXT, **QWEN3_5_MOE, **tied),
                                               vision_config=VISION, **tied)
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    return randomize_norms_and_routers(model).eval()


def write_layout(folder: Path, tokenizer_dir: Path, layout: Layout, seed: int = 0) -> Path:
    """Write ``layout``'s checkpoint into ``folder``; return the folder HF loads as its reference."""
    model = hf_model(layout, seed)
    tensors = _published_tensors(model, layout)
    model.config.architectures = [type(model).__name__]
    config = json.loads(model.config.to_json_string())
    if not layout.fp8:
        _write(folder, tokenizer_dir, config, tensors)
        return folder
    quantized, twin = quantize_fp8(tensors, FP8_BLOCK)
    _write(folder, tokenizer_dir, dict(config, quantization_config=_fp8_config(layout)), quantized)
    twin_folder = folder.parent / f"{folder.name}_dequantized"
    _write(twin_folder, tokenizer_dir, config, twin)
    return twin_folder


def _published_tensors(model, layout: Layout) -> dict[str, torch.Tensor]:
    """The model's tensors under their published names: MTP layers added, experts in the layout's
    form, the head dropped when tied."""
    tensors = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    if layout.tied:
        del tensors["lm_head.weight"]
    tensors |= _mtp_tensors(tensors, layout)
    if layout.experts == "per_expert":
        tensors = {n: t for name, tensor in tensors.items() for n, t in _per_expert(name, tensor)}
    return tensors


def _mtp_tensors(tensors: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """mtp.* as the releases hold them: a full-attention decoder layer (here a copy of the last
    full-attention layer), fc [H, 2H] and three norms."""
    prefix = "model.layers." if layout.family == "qwen3_next" else "model.language_model.layers."
    last_full = QWEN3_5_TEXT["num_hidden_layers"] - 1  # full attention in both families' tiny configs
    layer = {name.replace(f"{prefix}{last_full}.", "mtp.layers.0."): t.clone()
             for name, t in tensors.items() if name.startswith(f"{prefix}{last_full}.")}
    hidden = QWEN3_5_TEXT["hidden_size"]
    generator = torch.Generator().manual_seed(7)
    norms = {f"mtp.{n}.weight": torch.randn(hidden, generator=generator) * 0.1
             for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    return layer | norms | {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=generator) * 0.05}


def _per_expert(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """'...experts.gate_up_proj' [E, 2I, H] -> '...experts.{e}.gate_proj.weight', '.up_proj.weight';
    '...experts.down_proj' [E, H, I] -> '...experts.{e}.down_proj.weight'; other names as they are."""
    prefix, sep, leaf = name.rpartition(".experts.")
    if not sep or leaf not in ("gate_up_proj", "down_proj"):
        return [(name, tensor)]
    if leaf == "down_proj":
        return [(f"{prefix}.experts.{e}.down_proj.weight", tensor[e].clone()) for e in range(tensor.shape[0])]
    gate, up = tensor.chunk(2, dim=1)
    return [(f"{prefix}.experts.{e}.{proj}.weight", half[e].clone()) for e in range(tensor.shape[0])
            for proj, half in (("gate_proj", gate), ("up_proj", up))]


def _is_quantized(name: str, tensor: torch.Tensor) -> bool:
    module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    return (module in _QUANTIZED and tensor.dim() in (2, 3) and "visual" not in name
            and not name.endswith("shared_expert_gate.weight"))


def quantize_fp8(tensors: dict[str, torch.Tensor], block: list[int]) -> tuple[dict, dict]:
    """(checkpoint with FP8 weights and bf16 *_scale_inv tiles, float32 twin holding exactly the
    values those dequantize to). Per tile: scale = amax / 448 rounded to bf16, weight / scale in e4m3."""
    quantized, twin = {}, {}
    for name, tensor in tensors.items():
        if not _is_quantized(name, tensor):
            quantized[name] = twin[name] = tensor
            continue
        weight_fp8, scale, dequantized = _quantize_tiles(tensor.float(), block)
        quantized[name], quantized[name + "_scale_inv"], twin[name] = weight_fp8, scale, dequantized
    return quantized, twin


def _quantize_tiles(weight: torch.Tensor, block: list[int]):
    """weight [..., R, C] -> (e4m3 [..., R, C], bf16 scales [..., ceil(R / br), ceil(C / bc)], float32 dequantized),
    tile by tile with plain slicing (independent of Tengyun's dequantize)."""
    br, bc = block
    rows, cols = weight.shape[-2:]
    scales = torch.empty(*weight.shape[:-2], -(-rows // br), -(-cols // bc), dtype=torch.bfloat16)
    weight_fp8 = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    dequantized = torch.empty_like(weight)
    for i in range(scales.shape[-2]):
        for j in range(scales.shape[-1]):
            tile = (..., slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc))
            amax = weight[tile].abs().amax(dim=(-2, -1)).clamp(min=1e-8)
            scale = (amax / FP8_MAX).to(torch.bfloat16)
            scales[..., i, j] = scale
            q = (weight[tile] / scale.float()[..., None, None]).to(torch.float8_e4m3fn)
            weight_fp8[tile] = q
            dequantized[tile] = q.float() * scale.float()[..., None, None]
    return weight_fp8, scales, dequantized


def _fp8_config(layout: Layout) -> dict:
    prefix = "" if layout.family == "qwen3_next" else "model.language_model."
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": FP8_BLOCK,
            "modules_to_not_convert": ["lm_head", f"{prefix}embed_tokens", "mlp.gate", "mlp.shared_expert_gate",
                                       "linear_attn.in_proj_a", "linear_attn.in_proj_b", "model.visual"]}


def _write(folder: Path, tokenizer_dir: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Two shards and an index: layer 0's FP8 scales, the vision tower and MTP in the second."""
    folder.mkdir(parents=True, exist_ok=True)
    second = {n for n in tensors if n.endswith("_scale_inv") and ".layers.0." in n
              or n.startswith(("model.visual.", "mtp."))}
    shards = {"model-00001-of-00002.safetensors": {n: t for n, t in tensors.items() if n not in second},
              "model-00002-of-00002.safetensors": {n: t for n, t in tensors.items() if n in second}}
    for file, part in shards.items():
        save_file({n: t.contiguous() for n, t in part.items()}, folder / file, metadata={"format": "pt"})
    weight_map = {n: file for file, part in shards.items() for n in part}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
