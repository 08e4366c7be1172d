"""Kernel choice as data: each platform's ordered candidates, the first that can runs, the worker
builds it and `tengyun plan` counts its bytes from the same choice."""

from __future__ import annotations

import logging

import pytest

from tengyun.platforms import platform_class
from tengyun.platforms.kernel_choice import KINDS, KernelCandidate, KernelQuery, choose
from tengyun.quantization.config import detect_quantization


def _gptq_4bit_scheme():
    config = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    return detect_quantization({"quantization_config": config}).groups[0].scheme


def test_the_first_candidate_that_can_wins_and_the_earlier_ones_say_why():
    candidates = [KernelCandidate("fast", lambda q: "needs bfloat16" if q.dtype != "bfloat16" else None, str),
                  KernelCandidate("narrow", lambda q: "needs a block size of 128", str),
                  KernelCandidate("plain", lambda q: None, str)]
    assert choose("linear", candidates, KernelQuery("bfloat16")).name == "fast"
    choice = choose("linear", candidates, KernelQuery("float32"))
    assert choice.name == "plain"
    assert choice.passed_over == (("fast", "needs bfloat16"), ("narrow", "needs a block size of 128"))
    assert choice.explain() == "plain (fast: needs bfloat16; narrow: needs a block size of 128)"


def test_an_exhausted_list_is_an_error_naming_every_reason():
    with pytest.raises(LookupError, match="only: no"):
        choose("linear", [KernelCandidate("only", lambda q: "no", str)], KernelQuery("float32"))


@pytest.mark.parametrize("device", ["cpu", "cuda", "npu"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_platform_list_ends_in_a_candidate_that_always_can(device, kind):
    last = platform_class(device).kernel_candidates(kind)[-1]
    assert last.can_implement(KernelQuery("float32", block_size=7, kv_cache_dtype="float32",
                                          scheme=_gptq_4bit_scheme())) is None


def test_cpu_4bit_in_float32_runs_the_reference_and_says_why_each_cpu_kernel_could_not(caplog):
    cpu = platform_class("cpu")
    scheme = _gptq_4bit_scheme()
    with caplog.at_level(logging.DEBUG, logger="tengyun.platforms"):
        choice = cpu.choose_kernel("quant_linear", KernelQuery("float32", scheme=scheme))
    assert choice.name == "reference"
    assert dict(choice.passed_over) == {
        "cpu_w8a8": "not a W8A8 scheme", "cpu_gguf": "not a GGUF block type",
        "cpu_int8_layout": "8-bit weight-only served in bfloat16 only",
        "cpu_int4pack": "torch's int4 matmul takes bfloat16 activations only (--dtype bfloat16)"}
    assert "Kernel choice quant_linear: reference (cpu_w8a8: not a W8A8 scheme;" in caplog.text
    # the planner's bytes are the reference's: the checkpoint's tensors as stored
    assert cpu.quantized_weight_bytes(scheme, 256, 1024, "float32") == scheme.nbytes(256, 1024, 4, None)


def test_the_worker_builds_the_kernel_the_table_chose():
    import torch

    from tengyun.layers.quant_kernels import ReferenceWNA16Kernel
    from tengyun.platforms.cpu.kernels.quant import CpuInt4PackKernel

    cpu, scheme = platform_class("cpu")(), _gptq_4bit_scheme()
    assert type(cpu.quant_linear_kernel(scheme, torch.float32)) is ReferenceWNA16Kernel
    chosen = cpu.choose_kernel("quant_linear", KernelQuery("bfloat16", scheme=scheme)).name
    built = cpu.quant_linear_kernel(scheme, torch.bfloat16)
    assert (chosen, type(built)) == ("cpu_int4pack", CpuInt4PackKernel)


def test_cuda_attention_without_flash_attn_is_torch_sdpa_with_the_import_error_as_reason():
    from tengyun.platforms.cuda.kernels.attention import flash_attn_import_error

    if flash_attn_import_error() is None:
        pytest.skip("flash-attn imports here")
    choice = platform_class("cuda").choose_kernel("attention", KernelQuery("bfloat16", 256, "bfloat16"))
    assert choice.name == "torch_sdpa" and choice.passed_over == (("flash_attn", flash_attn_import_error()),)
