"""AWQ GEMM and GPTQ below the engine: config.json's section read as vLLM reads it (and refused
naming the field and the supported values), the packed words read in each format's order, the
CPU int4 matmul and the NPU kernel (on the CPU stand-in of torch_npu) serving both formats like
the reference, GPTQ act order through a permutation, and `tengyun plan` counting their bytes as
the engine holds them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tengyun.layers.quant_kernels import dequantize_unpacked, in_group_order, reference_kernel, unpacked_weight
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.platforms.cpu.kernels import quant_layout as cpu_quant_layout
from tengyun.platforms.cpu.kernels.quant import CpuInt4PackKernel, CpuInt8WeightOnlyKernel
from tengyun.platforms.cpu.kernels.quant_layout import quant_gemv_fits
from tengyun.platforms.npu.platform import NpuPlatform
from tengyun.quantization import awq, gptq
from tengyun.quantization.config import QuantizationError, detect_quantization

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "platforms"))
import fake_torch_npu  # noqa: E402
from awq_gptq_layouts import Format, quantize_layer, write_checkpoint  # noqa: E402
from conftest import plan_and_worker  # noqa: E402

OUT, IN = 96, 256


def _scheme(fmt: Format):
    return detect_quantization({"quantization_config": fmt.quantization_config()}).groups[0].scheme


def _layer(fmt: Format, dtype=torch.bfloat16, out=OUT, in_=IN):
    """-> (scheme, the tensors the layer keeps, as loaded in ``dtype``)."""
    scheme = _scheme(fmt)
    stored, _ = quantize_layer(fmt, "m.q_proj", out, in_, np.random.default_rng(0))
    stored = {k.removeprefix("m.q_proj."): v for k, v in stored.items()}
    return scheme, {t.name: stored[t.name].to(dtype) if t.dtype == "act" else stored[t.name]
                    for t in scheme.tensors if t.kept}


def test_awq_config_as_autoawq_writes_it():
    quant = detect_quantization({"quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "GEMM",
        "modules_to_not_convert": ["visual"]}})
    assert quant.describe() == "AWQ GEMM (int4, group 128, zero point)"
    assert quant.scheme_for("model.layers.0.mlp.down_proj").packing == "awq"
    for unquantised in ("lm_head", "model.layers.0.mlp.gate", "model.visual.blocks.0.proj"):
        assert quant.scheme_for(unquantised) is None
    with pytest.raises(QuantizationError, match=r"zero_point is False; Tengyun's AWQ reader supports true"):
        awq.from_config({"zero_point": False, "bits": 4, "group_size": 128})


def test_gptq_config_fields_pick_the_tensors_kept():
    scheme = _scheme(Format("gptq", sym=True))
    assert [t.name for t in scheme.tensors if t.kept] == ["qweight", "scales"]  # symmetric zeros, in-order g_idx
    act_order = _scheme(Format("gptq", desc_act=True))
    assert act_order.act_order and not act_order.tensor("scales").split_in  # every row-parallel rank holds all groups
    assert not _scheme(Format("gptq", desc_act=True, group=-1)).act_order  # one group: order cannot matter
    quant = gptq.from_config({"bits": 4, "group_size": 128, "modules_in_block_to_quantize": [["self_attn.q_proj"]]})
    assert quant.scheme_for("model.layers.3.self_attn.q_proj") and not quant.scheme_for("model.layers.3.mlp.up_proj")


def test_gptq_dynamic_first_matching_pattern_decides_as_vllm_reads_it():
    """GPTQModel's dynamic, in order: "-:" leaves a module dense, "+:" overrides the top-level values."""
    def config(*entries):
        return gptq.from_config({**Format("gptq").quantization_config(), "dynamic": dict(entries)})

    skip_mlp, down_8 = (r"-:.*\.mlp\..*", {}), (r"+:.*down_proj", {"bits": 8, "group_size": 64})
    quant = config(skip_mlp, down_8)
    assert quant.scheme_for("model.layers.0.mlp.down_proj") is None  # the first match skips it
    assert quant.scheme_for("model.layers.0.self_attn.o_proj").weight_bits == 4  # no match: the top level
    down = config(down_8, skip_mlp).scheme_for("model.layers.0.mlp.down_proj")
    assert (down.weight_bits, down.group_size) == (8, 64)
    assert config(down_8, skip_mlp).scheme_for("model.layers.0.mlp.up_proj") is None


@pytest.mark.parametrize("change, message", [
    (dict(bits=3), r"bits is 3; Tengyun's GPTQ reader supports 4, 8"),
    (dict(group_size=16), r"group_size is 16; Tengyun's GPTQ reader supports 32, 64, 128, 256, -1"),
    (dict(lm_head=True), r"lm_head is true .*re-quantize with lm_head false"),
    (dict(dynamic=[r"-:.*mlp.*"]), r"dynamic must map module regexes"),
    (dict(dynamic={r"+:.*\.1\..*": {"group_size": 16}}),
     r"quantization_config\.dynamic\['\+:[^']*'\]\.group_size is 16; Tengyun's GPTQ reader supports 32"),
])
def test_gptq_config_tengyun_cannot_run_names_the_field(change, message):
    with pytest.raises(QuantizationError, match=message):
        gptq.from_config({**Format("gptq").quantization_config(), **change})


def test_packed_words_read_in_each_format_s_order():
    """AWQ: one word 0x76543210 holds nibbles 0..7 from the low end, for outputs 0, 2, 4, 6, 1, 3,
    5, 7: outputs 0..7 read 0, 4, 1, 5, 2, 6, 3, 7 (minus 8, signed). GPTQ v1: zeros stored 7 are 8."""
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    q, _, zero, _ = unpacked_weight({"qweight": word, "qzeros": word, "scales": torch.ones(1, 8)},
                                    awq.gemm_scheme(32))
    assert (q.flatten() + 8).tolist() == [0, 4, 1, 5, 2, 6, 3, 7] == (zero.flatten() + 8).tolist()
    v1 = gptq.scheme(4, 32, False, False, "gptq")
    inputs = torch.tensor([[0x76543210]] * 4, dtype=torch.int32)  # [32 / 8, 1]: 32 inputs of one output
    q, _, zero, _ = unpacked_weight({"qweight": inputs, "qzeros": torch.tensor([[0x77777777]], dtype=torch.int32),
                                     "scales": torch.ones(1, 8)}, v1)  # qzeros [1, 8 / 8]: 8 outputs' zeros
    assert (q[0, :8] + 8).tolist() == list(range(8)) and zero.tolist() == [[0]] * 8


def _close_to_reference(kernel, scheme, tensors, prepared):
    """bf16 outputs of magnitude ~10: one ulp is 0.0625, and the two sum in different precisions."""
    x = torch.randn(5, IN, dtype=torch.bfloat16)
    torch.testing.assert_close(kernel.apply(x, prepared, None).float(),
                               reference_kernel(scheme).apply(x, tensors, None).float(), rtol=2e-2, atol=0.125)


@pytest.mark.parametrize("fmt", [Format("awq"), Format("awq", group=128), Format("gptq", sym=True),
                                 Format("gptq", desc_act=True), Format("gptq", desc_act=True, group=64,
                                                                       checkpoint_format="gptq_v2")])
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.skipif(
    not quant_gemv_fits(), reason="the compiled quant kernel does not run here"))])
def test_cpu_int4_matmul_serves_awq_and_gptq_like_the_reference(fmt, compiled):
    """Both repackings: torch's int4 layout and the compiled kernel's (cpu/kernels/quant_layout.py)."""
    scheme, tensors = _layer(fmt)
    chosen = CpuPlatform().quant_linear_kernel(scheme, torch.bfloat16)
    assert isinstance(chosen, CpuInt4PackKernel) and chosen.compiled == quant_gemv_fits()
    kernel = CpuInt4PackKernel(scheme, compiled=compiled)
    prepared = kernel.prepare(dict(tensors))
    assert ("qpacked" if compiled else "int4pack") in prepared and ("perm" in prepared) == fmt.desc_act
    torch.manual_seed(0)
    _close_to_reference(kernel, scheme, tensors, prepared)


@pytest.mark.skipif(not quant_gemv_fits(), reason="the compiled quant kernel does not run here")
@pytest.mark.parametrize("fmt", [Format("gptq", bits=8), Format("gptq", bits=8, sym=True),
                                 Format("gptq", bits=8, desc_act=True), Format("gptq", bits=8, group=-1)])
def test_cpu_8_bit_weight_only_runs_the_compiled_8_bit_layout_like_the_reference(fmt):
    """GPTQ 8-bit in bfloat16: the compiled kernel's 8-bit layout (it used to dequantize per call),
    every weight exactly the reference's (zero points as float32 offsets), outputs within bf16
    rounding at decode (1, 4 rows: float32 FMAs) and batch sizes (5, 32 rows: bf16 pairs), and
    the bytes `tengyun plan` counts."""
    scheme, tensors = _layer(fmt)
    kernel = CpuPlatform().quant_linear_kernel(scheme, torch.bfloat16)
    assert isinstance(kernel, CpuInt8WeightOnlyKernel)
    prepared = kernel.prepare(dict(tensors))
    assert "qpacked" in prepared and ("perm" in prepared) == fmt.desc_act
    unpacked, _ = in_group_order(unpacked_weight(tensors, scheme), scheme.group_size)
    weight_t = cpu_quant_layout.dequantized_t(prepared, 8, 0)  # [in, out], in group order
    assert torch.equal(weight_t.t(), dequantize_unpacked(unpacked, torch.float32))
    held = sum(t.untyped_storage().nbytes() for t in prepared.values())
    assert held == CpuPlatform.quantized_weight_bytes(scheme, OUT, IN, "bfloat16", IN)
    torch.manual_seed(0)
    for rows in (1, 4, 5, 32):
        x = torch.randn(rows, IN, dtype=torch.bfloat16)
        torch.testing.assert_close(kernel.apply(x, prepared, None).float(),
                                   reference_kernel(scheme).apply(x, tensors, None).float(), rtol=2e-2, atol=0.125)


def test_act_order_row_parallel_slice_pads_every_group_for_the_int4_matmul():
    """A rank's half of an act-order layer's inputs uses any group, fewer than 32 inputs each: every
    group is padded to 32 with inputs reading a zero activation, so the rank holds all 256 inputs'
    packed weights and the int4 matmul still runs; the result is the half's, exactly as the reference."""
    scheme, tensors = _layer(Format("gptq", desc_act=True))
    half = {"qweight": tensors["qweight"][: IN // 16], "g_idx": tensors["g_idx"][: IN // 2],
            "qzeros": tensors["qzeros"], "scales": tensors["scales"]}
    ordered, perm = in_group_order(unpacked_weight(half, scheme), scheme.group_size)
    assert ordered.q.shape == (OUT, IN) and perm.shape == (IN,) and int((perm == IN // 2).sum()) == IN // 2
    kernel = CpuInt4PackKernel(scheme, compiled=quant_gemv_fits())  # the layout the platform picks
    prepared = kernel.prepare(dict(half))
    assert ("qpacked" if kernel.compiled else "int4pack") in prepared
    held = sum(t.untyped_storage().nbytes() for t in prepared.values())  # what `tengyun plan` counts
    assert held == CpuPlatform.quantized_weight_bytes(scheme, OUT, IN // 2, "bfloat16", IN)
    x = torch.randn(3, IN // 2, dtype=torch.bfloat16)
    full = reference_kernel(scheme).apply(torch.cat([x, torch.zeros_like(x)], dim=1), tensors, None)
    torch.testing.assert_close(reference_kernel(scheme).apply(x, half, None), full)  # the other half contributes 0
    torch.testing.assert_close(kernel.apply(x, prepared, None).float(), full.float(), rtol=2e-2, atol=0.125)


@pytest.mark.parametrize("fmt", [Format("awq"), Format("gptq", bits=8, desc_act=True), Format("gptq", sym=True)])
def test_npu_weight_quant_batchmatmul_serves_awq_and_gptq(monkeypatch, fmt):
    fake = fake_torch_npu.module()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    scheme, tensors = _layer(fmt)
    kernel = NpuPlatform().quant_linear_kernel(scheme, torch.bfloat16)
    prepared = kernel.prepare(dict(tensors))
    assert ("antiquant_offset" in prepared) == (not fmt.sym) and ("perm" in prepared) == fmt.desc_act
    _close_to_reference(kernel, scheme, tensors, prepared)
    assert fake.calls["npu_weight_quant_batchmatmul"] == 1


def test_plan_bytes_of_a_row_parallel_act_order_layer_hold_every_group(monkeypatch):
    """down_proj at TP=2: 64 of 128 inputs per rank, 2 of 4 groups of 32 in order, all 4 in act order."""
    monkeypatch.setattr(CpuPlatform, "_compiled_quant_layout", staticmethod(lambda: False))
    in_order, act_order = _scheme(Format("gptq")), _scheme(Format("gptq", desc_act=True))
    packed = 64 * 64 // 2  # int32 words of 8 values: out x in / 2 bytes
    # in order: the rank's scales [2, 64] float32 and qzeros [2, 8] int32; g_idx dropped
    assert CpuPlatform.quantized_weight_bytes(in_order, 64, 64, "float32", 128) == packed + 2 * 64 * 4 + 2 * 8 * 4
    # act order, the reference: scales [4, 64] float32 + qzeros [4, 8] int32, and the rank's g_idx [64] int32
    assert CpuPlatform.quantized_weight_bytes(act_order, 64, 64, "float32", 128) == packed + 4 * 64 * 4 + 4 * 8 * 4 \
        + 64 * 4
    # bfloat16, torch's int4 layout padded to every group: 128 inputs packed, scales and zero terms
    # [4, 64, 2], the int64 permutation [128]
    assert CpuPlatform.quantized_weight_bytes(act_order, 64, 64, "bfloat16", 128) == 2 * packed + 4 * 64 * 2 * 2 \
        + 128 * 8
    # the compiled kernel's layout: 128 inputs packed, a bfloat16 scale and a uint8 zero point per
    # group and output [4, 64] (64 outputs: no padding to 32), the permutation
    monkeypatch.setattr(CpuPlatform, "_compiled_quant_layout", staticmethod(lambda: True))
    assert CpuPlatform.quantized_weight_bytes(act_order, 64, 64, "bfloat16", 128) == 2 * packed + 4 * 64 * (2 + 1) \
        + 128 * 8


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])  # bfloat16: torch's int4 layout, act order's permutation
@pytest.mark.parametrize("fmt", [Format("awq"), Format("gptq", desc_act=True), Format("gptq", bits=8, sym=True)])
def test_plan_counts_the_weights_the_engine_holds(tiny_checkpoints, tmp_path, fmt, dtype):
    folder, _ = write_checkpoint(tiny_checkpoints["qwen2"], tmp_path / "q", tmp_path / "twin", fmt)
    plan, quant, worker = plan_and_worker(folder, dtype)
    assert plan.quantization == quant.describe() == _scheme(fmt).description
    assert plan.stages[0].weight_bytes == worker.weight_bytes
