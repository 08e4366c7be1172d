"""GGUF kept quantised on Ascend (tengyun/platforms/npu/kernels/gguf.py) through npu_weight_quant_batchmatmul,
checked on CPU against its documented semantics (fake_torch_npu.py): the blocks' dequantized
weight up to bf16 rounding of the scales and offsets, Q8_0 and Q4_0 without an offset."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import fake_torch_npu
from tengyun.layers.gguf_kernels import GgufReferenceKernel, dequantize_blocks
from tengyun.quantization.gguf import GGML_TYPES, SUPPORTED_TYPES, scheme_for_type

FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2)}  # byte offsets of d (and m / dmin)


def _random_blocks(type_name: str, rows: int, in_: int) -> torch.Tensor:
    """uint8 [rows, in / block, block bytes]: random quants and 6-bit scales, finite fp16 fields."""
    rng = np.random.default_rng(0)
    ggml = GGML_TYPES[type_name]
    raw = rng.integers(0, 256, (rows, in_ // ggml.block, ggml.block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[type_name]:
        raw[..., offset:offset + 2] = rng.normal(0, 0.01, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return torch.from_numpy(raw)


@pytest.mark.parametrize("type_name", [t for t in SUPPORTED_TYPES if GGML_TYPES[t].scale_every == 32])
def test_npu_gguf_kernel_multiplies_by_the_blocks_through_torch_npu(type_name, monkeypatch):
    fake = fake_torch_npu.module()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    from tengyun.platforms.npu.platform import NpuPlatform
    from tengyun.platforms.npu.kernels.gguf import NpuGgufKernel

    kernel = NpuPlatform().quant_linear_kernel(scheme_for_type(type_name), torch.bfloat16)
    assert isinstance(kernel, NpuGgufKernel)
    qweight = _random_blocks(type_name, 64, 512)
    prepared = kernel.prepare({"qweight": qweight})
    assert ("offset" in prepared) == (type_name in ("Q4_1", "Q4_K"))
    x = torch.randn(5, 512).bfloat16()
    expected = x.float() @ dequantize_blocks(qweight, type_name).t()
    y = kernel.apply(x, prepared, None).float()
    assert fake.calls["npu_weight_quant_batchmatmul"] == 1
    assert ((y - expected).norm() / expected.norm()) < 1e-2
    float32 = NpuPlatform().quant_linear_kernel(scheme_for_type(type_name), torch.float32)
    assert type(float32) is GgufReferenceKernel


def test_q6_k_runs_the_reference_on_npu(monkeypatch):
    """torch_npu's grouped antiquant takes one scale per 32 inputs here; Q6_K holds one per 16."""
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu.module())
    from tengyun.platforms.npu.platform import NpuPlatform

    assert type(NpuPlatform().quant_linear_kernel(scheme_for_type("Q6_K"), torch.bfloat16)) is GgufReferenceKernel


def test_a_vocabulary_wide_gguf_head_is_split_by_columns(monkeypatch):
    """npu_weight_quant_batchmatmul takes N up to 65535: a Q8_0 LM head of 65600 outputs runs as two
    column chunks (the stand-in refuses one call of all 65600)."""
    fake = fake_torch_npu.module()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    from tengyun.platforms.npu.kernels.gguf import npu_gguf_kernel

    kernel = npu_gguf_kernel(scheme_for_type("Q8_0"), torch.bfloat16)
    qweight = _random_blocks("Q8_0", 65600, 64)
    prepared = kernel.prepare({"qweight": qweight})
    assert [part["weight"].shape for part in prepared["parts"]] == [(64, 32832), (64, 32768)]
    x = torch.randn(2, 64).bfloat16()
    expected = x.float() @ dequantize_blocks(qweight, "Q8_0").t()
    y = kernel.apply(x, prepared, None).float()
    assert fake.calls["npu_weight_quant_batchmatmul"] == 2
    assert ((y - expected).norm() / expected.norm()) < 1e-2
    with pytest.raises(RuntimeError, match=r"N \(65600\) must lie in \[1, 65535\]"):
        fake_torch_npu.npu_weight_quant_batchmatmul(x, torch.zeros(64, 65600, dtype=torch.int8),
                                                    torch.ones(2, 65600).bfloat16(), antiquant_group_size=32)
