"""compressed-tensors as llm-compressor writes it: Tengyun's packing, rounding and config.json
section agree with the compressed-tensors package (a reader nobody here wrote; skipped where it
does not import), and a config.json claiming a scheme Tengyun cannot run is refused naming the
field and the values it supports."""

from __future__ import annotations

import json

import pytest
import torch

from tengyun.quantization import compressed_tensors
from tengyun.quantization.config import QuantizationError, detect_quantization
from tengyun.quantization.packing import dequantize, pack_int32, quantize_symmetric, unpack_int32


def test_four_bit_packing_worked_example():
    row = torch.tensor([[-8, -1, 0, 7, 1, 2, 3, 4]], dtype=torch.int8)
    assert pack_int32(row, 4).item() & 0xFFFFFFFF == 0xCBA9F870
    assert torch.equal(unpack_int32(pack_int32(row, 4), 4), row)


def test_packing_matches_compressed_tensors():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers",
                                  reason="compressed-tensors is not installed")
    torch.manual_seed(0)
    for bits in (4, 8):
        q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (48, 96), dtype=torch.int8)
        for dim in (0, 1):
            assert torch.equal(pack_int32(q, bits, dim), helpers.pack_to_int32(q, bits, packed_dim=dim))
            assert torch.equal(unpack_int32(pack_int32(q, bits, dim), bits, dim), q)


@pytest.mark.parametrize("preset, bits, group", [("W4A16", 4, 32), ("W4A16", 4, None), ("W8A8", 8, None)])
def test_rounding_and_dequantization_match_compressed_tensors(preset, bits, group):
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    torch.manual_seed(0)
    weight = torch.randn(64, 128)
    q, scale = quantize_symmetric(weight, bits, group)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if preset == "W4A16":
        scheme.weights.group_size, scheme.weights.strategy = group, "group" if group else "channel"
        compressor, stored = PackedQuantizationCompressor, {"weight_packed": pack_int32(q, bits)}
        stored["weight_shape"] = torch.tensor([64, 128])
    else:
        compressor, stored = IntQuantizationCompressor, {"weight": q}
    stored["weight_scale"] = scale
    theirs = compressor.compress({"weight": weight, "weight_scale": scale}, scheme)
    for name, tensor in stored.items():  # their quantize + pack of our scales gives our tensors
        assert torch.equal(theirs[name], tensor), name
    assert torch.equal(compressor.decompress(stored, scheme)["weight"], dequantize(q, scale))


@pytest.mark.parametrize("scheme, group", [("w8a8", None), ("w4a16", 128), ("w4a16", 64), ("w4a16", None)])
def test_config_section_is_what_compressed_tensors_writes(scheme, group):
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
    import compressed_tensors as ct
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    preset = preset_name_to_scheme("W8A8" if scheme == "w8a8" else "W4A16", ["Linear"])
    if scheme == "w4a16":
        preset.weights.group_size, preset.weights.strategy = group, "group" if group else "channel"
    config = QuantizationConfig(config_groups={"group_0": preset}, ignore=["lm_head"], quantization_status="compressed",
                                format="int-quantized" if scheme == "w8a8" else "pack-quantized")
    # ModelCompressor.update_config: version, quant_method, sparsity_config and transform_config, then the dump
    expected = {"version": ct.__version__, "quant_method": "compressed-tensors", "sparsity_config": {},
                "transform_config": {}, **config.model_dump(exclude=["quant_method"])}
    written = compressed_tensors.quantization_config(scheme, group)
    assert json.loads(json.dumps(written)) == json.loads(json.dumps(expected))


def _config(fmt="pack-quantized", **weights):
    args = {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 128, "strategy": "group", "dynamic": False}
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt,
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**args, **weights},
                                                                  "input_activations": None}},
                                    "ignore": ["lm_head"], "quantization_status": "compressed"}}


@pytest.mark.parametrize("change, message", [
    (dict(num_bits=3), r"group_0\.weights\.num_bits is 3; Tengyun supports 4, 8"),
    (dict(group_size=48), r"weights\.group_size is 48; Tengyun supports 32, 64, 128, 256"),
    (dict(strategy="tensor"), r"weights\.strategy is 'tensor'; Tengyun supports 'group', 'channel'"),
    (dict(type="float"), r"weights\.type is 'float'; Tengyun supports 'int'"),
    (dict(actorder="group"), r"actorder 'group' .*weight_g_idx.* not supported"),
    (dict(fmt="float-quantized"), r"format 'float-quantized' .*not supported.*int-quantized.*pack-quantized"),
])
def test_a_scheme_tengyun_cannot_run_names_the_field_and_supported_values(change, message):
    fmt = change.pop("fmt", "pack-quantized")
    with pytest.raises(QuantizationError, match=message):
        detect_quantization(_config(fmt, **change))


def test_w8a8_needs_dynamic_per_token_activations():
    cfg = json.loads(json.dumps(compressed_tensors.quantization_config("w8a8")))
    cfg["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    with pytest.raises(QuantizationError, match=r"input_activations\.dynamic is False; Tengyun supports true"):
        detect_quantization({"quantization_config": cfg})


def test_quantization_flag_forces_or_must_agree():
    assert detect_quantization({}) is None
    assert detect_quantization(_config(), "compressed-tensors").method == "compressed-tensors"
    with pytest.raises(QuantizationError, match="--quantization awq disagrees.*'compressed-tensors'"):
        detect_quantization(_config(), "awq")
    with pytest.raises(QuantizationError, match="method 'bitsandbytes'.*Tengyun reads: .*compressed-tensors"):
        detect_quantization({"quantization_config": {"quant_method": "bitsandbytes"}})


def test_targets_and_ignore_pick_each_module_scheme():
    quant = detect_quantization({"quantization_config": {
        **compressed_tensors.quantization_config("w4a16", 32, ignore=("lm_head", "re:.*mlp\\.down_proj$"))}})
    assert quant.scheme_for("model.layers.0.self_attn.q_proj").description.startswith("compressed-tensors W4A16")
    assert quant.scheme_for("model.layers.3.mlp.down_proj") is None
    assert quant.scheme_for("lm_head") is None
    assert quant.kernels == ("wna16_int",)
