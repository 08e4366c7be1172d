"""The NPU quantised linears (tengyun/platforms/npu/kernels/quant.py, matmul_limits.py) against the
strict stand-in (fake_torch_npu.py): the scale encodings npu_quant_matmul documents, and the shape
limits of the quantised matmuls (split by columns, or the reference kernel with a log line). Each
"mistake" test calls the op as the code did before the fix and shows the stand-in refuses it."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from tengyun.layers.quant_kernels import reference_kernel
from tengyun.platforms.npu.kernels.matmul_limits import ON_REFERENCE, column_chunks
from tengyun.quantization.compressed_tensors import w8a8_scheme, weight_only_scheme
from tengyun.quantization.modelslim import static_scheme
from tengyun.quantization.packing import pack_int32, quantize_symmetric

sys.path.insert(0, str(Path(__file__).parent))
import fake_torch_npu  # noqa: E402


@pytest.fixture
def npu(monkeypatch):
    fake = fake_torch_npu.module()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


def _kernel(scheme):
    from tengyun.platforms.npu.kernels.quant import npu_quant_kernel

    return npu_quant_kernel(scheme)


def _w8a8(out, in_, dtype):
    torch.manual_seed(0)
    q, scale = quantize_symmetric(torch.randn(out, in_), 8, None)
    return {"weight": q, "weight_scale": scale.reshape(-1, 1).to(dtype)}


def _static(out, in_, deq_dtype):
    torch.manual_seed(0)
    q, scale = quantize_symmetric(torch.randn(out, in_), 8, None)
    deq = (0.02 * scale.flatten()).float()
    return {"weight": q, "quant_bias": torch.randint(-500, 500, (out,), dtype=torch.int32),
            "deq_scale": deq.view(torch.int32).to(torch.int64) if deq_dtype == torch.int64 else deq,
            "input_scale": torch.tensor([0.02], dtype=torch.float16), "input_offset": torch.tensor([3.0],
                                                                                                  dtype=torch.float16)}


def test_fp16_dynamic_w8a8_passes_a_float32_scale(npu):
    """npu_quant_matmul's dtype table: pertoken_scale with a float16 output takes only a float32 scale."""
    kernel, tensors = _kernel(w8a8_scheme()), _w8a8(96, 128, torch.float16)
    prepared = kernel.prepare(dict(tensors))
    assert prepared["weight_scale"].dtype == torch.float32
    x = torch.randn(5, 128, dtype=torch.float16)
    torch.testing.assert_close(kernel.apply(x, prepared, None), reference_kernel(w8a8_scheme()).apply(x, tensors, None),
                               rtol=1e-3, atol=1e-2)
    # the mistake: the weight scale in the model's dtype
    x_q, s_x = npu.npu_dynamic_quant(x)
    with pytest.raises(RuntimeError, match="scale torch.float16 with a torch.float16 output with pertoken_scale"):
        npu.npu_quant_matmul(x_q, prepared["weight"], tensors["weight_scale"].flatten(), pertoken_scale=s_x,
                             output_dtype=torch.float16)


@pytest.mark.parametrize("stored", [torch.float32, torch.int64])  # a bfloat16 export's float32, float16's int64
def test_fp16_static_w8a8_takes_deq_scale_from_npu_trans_quant_param(npu, stored):
    scheme, tensors = static_scheme("int64" if stored == torch.int64 else "float32"), _static(96, 128, stored)
    kernel = _kernel(scheme)
    prepared = kernel.prepare(dict(tensors))
    deq = prepared["deq_scale"]
    # the documented encoding: the float32's top 19 bits, bit 46 set
    assert torch.equal(prepared["deq_scale_int64"], (deq.view(torch.int32).to(torch.int64) & 0xFFFFE000) | 1 << 46)
    assert npu.calls["npu_trans_quant_param"] == 1
    x = torch.randn(5, 128, dtype=torch.float16)
    x_q = npu.npu_quantize(x, prepared["scale_reciprocal"], prepared["offset"], torch.qint8, -1, False)
    cut = (deq.view(torch.int32).to(torch.int64) & 0xFFFFE000).to(torch.int32).view(torch.float32)  # 19 bits
    expected = ((x_q.float() @ tensors["weight"].float().t() + tensors["quant_bias"].float()) * cut).half()
    torch.testing.assert_close(kernel.apply(x, prepared, None), expected)
    # the mistake: the float's raw bits re-encoded by hand as the int64 scale
    with pytest.raises(RuntimeError, match="must come from npu_trans_quant_param"):
        npu.npu_quant_matmul(x_q, prepared["weight"], deq.view(torch.int32).to(torch.int64),
                             bias=prepared["quant_bias"], output_dtype=torch.float16)


def test_bf16_static_w8a8_passes_deq_scale_as_float32(npu):
    scheme, tensors = static_scheme("int64"), _static(96, 128, torch.int64)
    tensors.update(input_scale=tensors["input_scale"].bfloat16(), input_offset=tensors["input_offset"].bfloat16())
    kernel = _kernel(scheme)
    prepared = kernel.prepare(dict(tensors))
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    x_q = npu.npu_quantize(x, prepared["scale_reciprocal"], prepared["offset"], torch.qint8, -1, False)
    expected = (x_q.float() @ tensors["weight"].float().t() + tensors["quant_bias"].float()) * prepared["deq_scale"]
    torch.testing.assert_close(kernel.apply(x, prepared, None), expected.bfloat16())


def test_column_chunks_stay_under_the_ops_limit():
    assert [(s.start, s.stop) for s in column_chunks(151936)] == [(0, 50688), (50688, 101376), (101376, 151936)]
    assert column_chunks(4096) == [slice(0, 4096)]
    assert all(s.stop - s.start <= 65535 for n in (65535, 65536, 130944, 200003) for s in column_chunks(n))


def test_a_weight_wider_than_65535_outputs_is_split_by_columns(npu):
    """npu_quant_matmul: x2's last dim (N) at most 65535 -> two chunks, as vLLM-Ascend splits."""
    scheme, tensors = w8a8_scheme(), _w8a8(70000, 32, torch.bfloat16)
    kernel = _kernel(scheme)
    prepared = kernel.prepare(dict(tensors))
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(kernel.apply(x, prepared, None), reference_kernel(scheme).apply(x, tensors, None))
    assert npu.calls["npu_quant_matmul"] == 2
    # the mistake: the whole weight in one call
    x_q, s_x = npu.npu_dynamic_quant(x)
    with pytest.raises(RuntimeError, match="last dims at most 65535"):
        npu.npu_quant_matmul(x_q, tensors["weight"].t().contiguous(), tensors["weight_scale"].flatten().float(),
                             pertoken_scale=s_x, output_dtype=torch.bfloat16)


def test_wide_int4_weight_only_layer_is_split_by_columns(npu):
    out, in_, group = 65600, 64, 32
    torch.manual_seed(0)
    q, scale = quantize_symmetric(torch.randn(out, in_), 4, group)
    scheme, tensors = weight_only_scheme(4, group, True), {"weight_packed": pack_int32(q, 4),
                                                            "weight_scale": scale.bfloat16()}
    kernel = _kernel(scheme)
    x = torch.randn(2, in_, dtype=torch.bfloat16)
    y = kernel.apply(x, kernel.prepare(dict(tensors)), None)
    torch.testing.assert_close(y.float(), reference_kernel(scheme).apply(x, tensors, None).float(),
                               rtol=2e-2, atol=0.125)
    assert npu.calls["npu_weight_quant_batchmatmul"] == 2


def test_k_above_65535_runs_the_reference_kernel_with_a_log_line(npu, caplog):
    scheme, tensors = w8a8_scheme(), _w8a8(8, 65600, torch.bfloat16)
    kernel = _kernel(scheme)
    with caplog.at_level(logging.WARNING):
        prepared = kernel.prepare(dict(tensors))
    assert ON_REFERENCE in prepared and "65600 inputs exceed the 65535" in caplog.text
    x = torch.randn(2, 65600, dtype=torch.bfloat16)
    torch.testing.assert_close(kernel.apply(x, prepared, None), reference_kernel(scheme).apply(x, tensors, None))
    assert npu.calls["npu_quant_matmul"] == 0


def _wna16(bits, group, out=96, in_=128):
    torch.manual_seed(0)
    q, scale = quantize_symmetric(torch.randn(out, in_), bits, group)
    tensors = {"weight_packed": pack_int32(q, bits), "weight_scale": scale.bfloat16()}
    return weight_only_scheme(bits, group, True), tensors


def test_group_size_the_op_refuses_runs_the_reference_naming_group_size(npu, caplog):
    """npu_weight_quant_batchmatmul: antiquant_group_size in [32, K - 1], a multiple of 32."""
    scheme, tensors = _wna16(8, 16)
    kernel = _kernel(scheme)
    with caplog.at_level(logging.WARNING):
        prepared = kernel.prepare(dict(tensors))
    assert ON_REFERENCE in prepared and "group_size 16" in caplog.text
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    torch.testing.assert_close(kernel.apply(x, prepared, None), reference_kernel(scheme).apply(x, tensors, None))
    assert npu.calls["npu_weight_quant_batchmatmul"] == 0
    # the mistake: group 16 passed to the op
    with pytest.raises(RuntimeError, match="antiquant_group_size 16 must lie in"):
        npu.npu_weight_quant_batchmatmul(x, torch.zeros(128, 96, dtype=torch.int8), torch.ones(8, 96).bfloat16(),
                                         antiquant_group_size=16)


def test_one_group_of_all_inputs_runs_per_channel(npu):
    """group_size = K is outside [32, K - 1], but it is per-channel scaling: antiquant_group_size 0."""
    scheme, tensors = _wna16(8, 128)
    kernel = _kernel(scheme)
    prepared = kernel.prepare(dict(tensors))
    assert ON_REFERENCE not in prepared and prepared["antiquant_scale"].shape == (96,)
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    torch.testing.assert_close(kernel.apply(x, prepared, None).float(),
                               reference_kernel(scheme).apply(x, tensors, None).float(), rtol=2e-2, atol=0.125)
    assert npu.calls["npu_weight_quant_batchmatmul"] == 1


def test_int4_outputs_off_8_run_the_reference(npu, caplog):
    scheme, tensors = _wna16(4, 32, out=100)
    kernel = _kernel(scheme)
    with caplog.at_level(logging.WARNING):
        prepared = kernel.prepare(dict(tensors))
    assert ON_REFERENCE in prepared and "not a multiple of 8" in caplog.text
    assert npu.calls["npu_convert_weight_to_int4pack"] == 0
    with pytest.raises(RuntimeError, match="must be a multiple of 8"):  # the mistake: packing it anyway
        npu.npu_convert_weight_to_int4pack(torch.zeros(128, 100, dtype=torch.int32))
