"""Tiny msModelSlim checkpoints written here from its published layout (msModelSlim's weight
format doc and vLLM-Ascend's W8A8 / W8A8_DYNAMIC schemes), apart from Tengyun's reader:
quant_model_description.json {tensor: type} with "model_quant_type", one safetensors file, the
HF config.json unchanged (no quantization_config), and an fp32 twin holding the dequantized
weights for HF to run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CALIBRATION_PROMPT = list(range(3, 83))


def _is_linear(name: str, tensor: torch.Tensor) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight") and tensor.dim() == 2


def activation_ranges(source: Path) -> dict[str, tuple[float, float]]:
    """{module: (min, max)} of every decoder linear layer's input over CALIBRATION_PROMPT, as a
    min-max observer calibrates static W8A8 (q/k/v and gate/up see one input, so they agree)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ranges = {}

    def observe(name):
        def hook(module, args):
            ranges[name] = (float(args[0].min()), float(args[0].max()))
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            module.register_forward_pre_hook(observe(name))
    with torch.no_grad():
        model(torch.tensor([CALIBRATION_PROMPT]))
    return ranges


def _static_input(low: float, high: float) -> tuple[float, float]:
    """min-max asymmetric int8: (scale, offset) with x ~ (x_q - offset) * scale, x_q in [-128, 127]."""
    low, high = min(low, 0.0), max(high, 0.0)
    scale = (high - low) / 255.0
    return scale, float(round(-128 - low / scale))


def write_modelslim(source: Path, out: Path, quant_type: str, deq_scale_int64: bool = False) -> tuple[Path, Path]:
    """``source`` (a tiny fp32 HF folder) -> (ModelSlim ``quant_type`` folder, fp32 twin folder
    holding the dequantized weights, and for static W8A8 the biases as quant_bias rounds them).
    ``deq_scale_int64``: store deq_scale as msModelSlim does for float16 models (float32 bits in int64)."""
    tensors = load_file(source / "model.safetensors")
    ranges = activation_ranges(source) if quant_type == "W8A8" else {}
    stored, dense, description = {}, {}, {"model_quant_type": quant_type, "version": "1.0.0"}
    rounded_bias = {}
    for name, tensor in tensors.items():
        if not _is_linear(name, tensor):
            stored[name] = dense[name] = tensor
            description[name] = "FLOAT"
            continue
        module = name.removesuffix(".weight")
        scale = tensor.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0  # [out, 1] symmetric
        q = torch.clamp(torch.round(tensor / scale), -128, 127).to(torch.int8)
        dense[name] = q.float() * scale
        quantized = {"weight": q, "weight_scale": scale, "weight_offset": torch.zeros_like(scale)}
        if quant_type == "W8A8":
            input_scale, input_offset = _static_input(*ranges[module])
            deq = (input_scale * scale.squeeze(1)).float()
            bias = tensors.get(f"{module}.bias", torch.zeros(q.shape[0]))
            quant_bias = torch.round(bias / deq - q.float().sum(dim=1) * input_offset).to(torch.int32)
            if f"{module}.bias" in tensors:  # the twin's bias: what quant_bias adds, bias / deq_scale rounded
                rounded_bias[f"{module}.bias"] = (quant_bias + q.float().sum(dim=1) * input_offset) * deq
            if deq_scale_int64:
                deq = deq.view(torch.int32).to(torch.int64)
            quantized.update(input_scale=torch.tensor([input_scale]), input_offset=torch.tensor([input_offset]),
                             deq_scale=deq, quant_bias=quant_bias)
        for suffix, value in quantized.items():
            stored[f"{module}.{suffix}"] = value.contiguous()
            description[f"{module}.{suffix}"] = quant_type
    dense.update(rounded_bias)
    folder, twin = out / quant_type.lower(), out / f"{quant_type.lower()}_twin"
    for path, weights in ((folder, stored), (twin, dense)):
        path.mkdir(parents=True)
        save_file(weights, str(path / "model.safetensors"))
        for f in source.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, path / f.name)
    (folder / "quant_model_description.json").write_text(json.dumps(description, indent=2))
    return folder, twin


def input_quantization(folder: Path) -> dict[str, tuple[float, float]]:
    """{module: (input_scale, input_offset)} of a static W8A8 folder."""
    tensors = load_file(folder / "model.safetensors")
    return {k.removesuffix(".input_scale"): (float(v), float(tensors[k.replace("input_scale", "input_offset")]))
            for k, v in tensors.items() if k.endswith(".input_scale")}
