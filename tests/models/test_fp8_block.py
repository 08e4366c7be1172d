"""FP8 block-quantized checkpoints: the dequantization by tiles (partial edge tiles, 3-D fused
experts), the loader reading scales from another shard, and the errors for checkpoints and configs
that disagree; which quantization configs EngineConfig accepts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from tengyun.config import EngineConfig
from tengyun.layers.fused_moe import FusedMoE
from tengyun.model_spec import fp8_weight_block
from tengyun.models.fp8_block import dequantize
from tengyun.models.loader import load_weights
from checkpoint_layouts import _quantize_tiles

BLOCK = (128, 128)  # the releases' weight_block_size


def _tile_by_tile(weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    out = torch.empty(weight.shape)
    for i in range(scale.shape[-2]):
        for j in range(scale.shape[-1]):
            tile = (..., slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            out[tile] = weight[tile].float() * scale[..., i, j, None, None].float()
    return out


def test_dequantize_scales_each_128_tile_including_partial_edges():
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(300, 200, generator=g) * 50).to(torch.float8_e4m3fn)  # 3 x 2 tiles, last ones partial
    scale = torch.rand(3, 2, generator=g).to(torch.bfloat16)
    assert torch.equal(dequantize(weight, scale, BLOCK), _tile_by_tile(weight, scale, BLOCK))
    fused = (torch.randn(4, 260, 130, generator=g) * 50).to(torch.float8_e4m3fn)  # [E, 2I, H] experts
    fused_scale = torch.rand(4, 3, 2, generator=g)
    assert torch.equal(dequantize(fused, fused_scale, BLOCK), _tile_by_tile(fused, fused_scale, BLOCK))
    with pytest.raises(ValueError, match=r"shape \[2, 3\], but a weight of shape \[300, 200\] in weight_block_size "
                                         r"\[128, 128\] tiles needs \[3, 2\]"):
        dequantize(weight, scale.t(), BLOCK)


class _Experts(nn.Module):
    """One MoE block's experts, named as Qwen3.5-MoE names them."""

    checkpoint_name_to_param = staticmethod(FusedMoE.checkpoint_name_to_param)
    checkpoint_transform = staticmethod(FusedMoE.split_fused_experts)

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.experts = FusedMoE(num_experts=2, top_k=1, hidden_size=64, intermediate_size=24,
                                      renormalize=False, dtype=torch.float32)


def _fused_fp8_checkpoint(folder, block=(16, 32)):
    """model.experts.gate_up_proj [2, 48, 64] and down_proj [2, 64, 24] in FP8, their scales in a second
    shard; returns the dequantized float32 tensors."""
    g = torch.Generator().manual_seed(1)
    gate_up, down = torch.randn(2, 48, 64, generator=g), torch.randn(2, 64, 24, generator=g)
    (gu8, gu_scale, gu), (d8, d_scale, d) = _quantize_tiles(gate_up, block), _quantize_tiles(down, block)
    save_file({"model.experts.gate_up_proj": gu8, "model.experts.down_proj": d8}, folder / "model-1.safetensors")
    save_file({"model.experts.gate_up_proj_scale_inv": gu_scale, "model.experts.down_proj_scale_inv": d_scale},
              folder / "model-2.safetensors")
    return gu, d


def test_fused_fp8_experts_load_dequantized_with_scales_from_another_shard(tmp_path):
    gate_up, down = _fused_fp8_checkpoint(tmp_path)
    model = _Experts()
    load_weights(model, tmp_path, "safetensors", fp8_block=(16, 32))
    assert torch.equal(model.model.experts.w13_weight, gate_up)  # [E, 2I, H]: gate rows, then up
    assert torch.equal(model.model.experts.w2_weight, down)


def test_scales_without_an_fp8_config_and_fp8_without_scales_are_named(tmp_path):
    _fused_fp8_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"holds FP8 block scales \(e.g. model.experts.down_proj_scale_inv\) but "
                                         r"config.json's quantization_config is not quant_method 'fp8'"):
        load_weights(_Experts(), tmp_path, "safetensors")
    with pytest.raises(ValueError, match=r"scales model.experts.down_proj_scale_inv in .*model-2.safetensors have "
                                         r"shape \[2, 4, 1\], but a weight of shape \[2, 64, 24\] in weight_block_size "
                                         r"\[64, 64\] tiles needs \[2, 1, 1\]: config.json's quantization_config "
                                         r"weight_block_size disagrees with the checkpoint"):
        load_weights(_Experts(), tmp_path, "safetensors", fp8_block=(64, 64))
    (tmp_path / "model-2.safetensors").unlink()
    with pytest.raises(ValueError, match=r"2 float8 checkpoint tensor\(s\) in .* have no '_scale_inv' block scales"):
        load_weights(_Experts(), tmp_path, "safetensors", fp8_block=(16, 32))


@pytest.mark.parametrize("quant, block", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}, (128, 128)),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, (128, 128)),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, None),  # per-tensor FP8
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, None),
    ({"quant_method": "awq", "bits": 4}, None),
    (None, None),
])
def test_only_dynamic_fp8_with_a_block_size_is_recognised(quant, block):
    assert fp8_weight_block(quant) == block


def _with_quantization(source, folder, quant):
    folder = shutil.copytree(source, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, quantization_config=quant)))
    return folder


def test_fp8_block_config_is_accepted_and_per_tensor_fp8_refused_with_a_hint(tiny_hybrid_checkpoints, tmp_path):
    source = tiny_hybrid_checkpoints["qwen3_5"]
    block = _with_quantization(source, tmp_path / "block", {"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert EngineConfig(str(block)).finalize().model_spec.fp8_block == (128, 128)
    per_tensor = _with_quantization(source, tmp_path / "per_tensor", {"quant_method": "fp8"})
    with pytest.raises(ValueError, match="quant_method 'fp8'.*cannot load yet; an fp8 checkpoint loads when it is "
                                         r"block-quantized \(weight_block_size"):
        EngineConfig(str(per_tensor)).finalize()
