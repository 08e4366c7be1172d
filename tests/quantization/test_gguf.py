"""GGUF kept quantised (--quantization gguf): every ggml type Tengyun keeps dequantizes as the
gguf package's own dequantize does (a reader nobody here wrote), on real blocks from the
embedded GGUFs and on random ones; the kernels multiply by exactly those weights; a .gguf Tengyun
cannot keep is refused naming the tensor, the supported types and the way to load it
dequantized; `tengyun plan` counts the blocks."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from tengyun.layers.gguf_kernels import (  # noqa: E402
    ROWS_PER_TILE, GgufReferenceKernel, dequantize_blocks, q4_0_as_q8_0, q5_0_as_q8_0, q_scale_offset,
)
from tengyun.layers.quant_kernels import reference_kernel  # noqa: E402
from tengyun.models.gguf_quantized import kept_types  # noqa: E402
from tengyun.models.gguf_reader import shared_readers  # noqa: E402
from tengyun.models.model_source import convert_gguf, qwen_coder_gguf, smollm2_gguf  # noqa: E402
from tengyun.platforms.cpu.platform import CpuPlatform  # noqa: E402
from tengyun.platforms.cpu.kernels.gguf import (  # noqa: E402
    DEQUANTIZE_FROM_TOKENS, CpuGgufCompiledKernel, CpuGgufDequantizedKernel, CpuGgufInt4PackKernel, gguf_kernel,
    unpacked_weight,
)
from tengyun.platforms.cpu.kernels import quant_layout as cpu_quant_layout  # noqa: E402
from tengyun.platforms.cpu.kernels.quant_layout import quant_gemv_fits  # noqa: E402
from tengyun.quantization.config import QuantizationError, detect_quantization  # noqa: E402
from tengyun.quantization.gguf import GGML_TYPES, SUPPORTED_TYPES, quantization_config, scheme_for_type  # noqa: E402

# byte offsets of the fp16 fields: d (and m / dmin)
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,)}
PER_32 = [t for t in SUPPORTED_TYPES if GGML_TYPES[t].scale_every == 32]  # what torch's int4 matmul takes


def _random_blocks(type_name: str, rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, blocks * block bytes]: every quant and 6-bit scale bit random, the fp16
    fields finite values of a weight's size."""
    rng = np.random.default_rng(seed)
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][1]
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for offset in FP16_FIELDS[type_name]:
        raw[..., offset:offset + 2] = rng.normal(0, 0.01, (rows, blocks)).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, blocks * size)


def _ours(raw: np.ndarray, type_name: str) -> np.ndarray:
    blocks = torch.from_numpy(raw.copy()).reshape(raw.shape[0], -1, GGML_TYPES[type_name].block_bytes)
    return dequantize_blocks(blocks, type_name).numpy()


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_dequantization_equals_the_gguf_package_on_random_blocks(type_name):
    raw = _random_blocks(type_name, rows=8, blocks=3)
    np.testing.assert_array_equal(_ours(raw, type_name), gguf_dequantize(raw, gguf.GGMLQuantizationType[type_name]))


@pytest.mark.parametrize("type_name, as_q8_0", [("Q5_0", q5_0_as_q8_0), ("Q4_0", q4_0_as_q8_0)])
def test_q5_0_and_q4_0_re_encode_as_q8_0_losslessly(type_name, as_q8_0):
    raw = _random_blocks(type_name, rows=8, blocks=3)
    blocks = torch.from_numpy(raw).reshape(8, 3, -1)
    np.testing.assert_array_equal(dequantize_blocks(as_q8_0(blocks), "Q8_0").numpy(),
                                  gguf_dequantize(raw, gguf.GGMLQuantizationType[type_name]))


def _real_tensors():
    """(file, tensor) for the first tensor of each supported type in the embedded GGUFs
    (SmolLM2: Q8_0 token_embd, Q4_1 layers; Qwen2.5-Coder: Q8_0 output, Q4_K ffn_down)."""
    found = []
    for locate in (smollm2_gguf, qwen_coder_gguf):
        try:
            path = locate()
        except FileNotFoundError:
            continue
        seen = set()
        for tensor in gguf.GGUFReader(str(path)).tensors:
            if tensor.tensor_type.name in (*SUPPORTED_TYPES, "Q5_0") and tensor.tensor_type.name not in seen:
                seen.add(tensor.tensor_type.name)
                found.append(pytest.param(tensor, id=f"{path.stem}:{tensor.name}:{tensor.tensor_type.name}"))
    return found


@pytest.mark.parametrize("tensor", _real_tensors())
def test_dequantization_equals_the_gguf_package_on_real_blocks(tensor):
    raw = np.asarray(tensor.data)[:256]
    if tensor.tensor_type.name == "Q5_0":  # stored as Q8_0
        ours = dequantize_blocks(q5_0_as_q8_0(torch.from_numpy(raw.copy()).reshape(raw.shape[0], -1, 22)), "Q8_0")
    else:
        ours = torch.from_numpy(_ours(raw, tensor.tensor_type.name))
    np.testing.assert_array_equal(ours.numpy(), gguf_dequantize(raw, tensor.tensor_type))


def test_real_blocks_cover_the_types_the_embedded_models_hold():
    held = {p.values[0].tensor_type.name for p in _real_tensors()}
    assert {"Q8_0", "Q4_1"} <= held  # SmolLM2 (Q4_K, Q6_K, Q5_0 too when Qwen2.5-Coder is installed)


def _blocks(type_name: str, rows: int, in_: int, seed: int = 0) -> torch.Tensor:
    ggml = GGML_TYPES[type_name]
    raw = _random_blocks(type_name, rows, in_ // ggml.block, seed)
    return torch.from_numpy(raw).reshape(rows, -1, ggml.block_bytes)


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_reference_kernel_multiplies_by_the_dequantized_weight_tile_by_tile(type_name):
    qweight = _blocks(type_name, ROWS_PER_TILE + 48, 512)  # two tiles, the second partial
    x = torch.randn(3, 5, 512)
    bias = torch.randn(ROWS_PER_TILE + 48)
    kernel = reference_kernel(scheme_for_type(type_name))
    assert isinstance(kernel, GgufReferenceKernel)
    y = kernel.apply(x, {"qweight": qweight}, bias)
    torch.testing.assert_close(y, F.linear(x, dequantize_blocks(qweight, type_name), bias), rtol=1e-4, atol=1e-4)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


@pytest.mark.parametrize("rows", [64, 32])
def test_unpack_int4_reads_both_row_block_widths(rows):
    """torch packs int4 weights in blocks of 64 output rows where its kernels run AVX-512 and 32 where
    they run AVX2: byte j of each K run holds row j low and row rows / 2 + j high. Laid out by hand
    here, and read back from torch's own packing on this CPU (whichever width it uses)."""
    from tengyun.platforms.cpu.kernels import gguf as cpu_gguf

    q = torch.randint(0, 16, (2 * rows, 8), generator=torch.Generator().manual_seed(rows), dtype=torch.uint8)
    blocks = q.view(2, rows, 8).transpose(1, 2)  # [row blocks, k, rows]
    packed = (blocks[..., :rows // 2] | (blocks[..., rows // 2:] << 4)).reshape(2 * rows, 4)
    assert torch.equal(cpu_gguf.unpack_int4(packed, rows), q)
    assert cpu_gguf._unpack_rows() in (64, 32)
    mine = torch.randint(0, 16, (128, 64), dtype=torch.int32)
    assert torch.equal(cpu_gguf.unpack_int4(torch.ops.aten._convert_weight_to_int4pack_for_cpu(mine, 1)).int(), mine)


@pytest.mark.parametrize("type_name", PER_32)
def test_cpu_int4_planes_compute_the_blocks_with_bf16_scales(type_name):
    """torch's int4 matmul takes (n - 8) * scale + zero with scale and zero in bfloat16 (Q8_0 as
    two such planes): the weights are the blocks' with d (or the 4-bit types' scale and zero)
    rounded to bfloat16 -- Q8_0 bf16(d) q exactly -- and the products agree up to bf16 sums."""
    chosen = CpuPlatform().quant_linear_kernel(scheme_for_type(type_name), torch.bfloat16)
    assert isinstance(chosen, CpuGgufCompiledKernel if quant_gemv_fits() else CpuGgufInt4PackKernel)
    kernel = gguf_kernel(scheme_for_type(type_name), torch.bfloat16, compiled=False)
    assert isinstance(kernel, CpuGgufInt4PackKernel)
    qweight = _blocks(type_name, 64, 512)
    prepared = kernel.prepare({"qweight": qweight})
    planes = 2 if type_name == "Q8_0" else 1
    assert set(prepared) == {f"{k}{i}" for i in range(planes) for k in ("int4pack", "scales_and_zeros")}
    q, scale, offset = q_scale_offset(qweight, type_name)
    groups = q.float().reshape(64, -1, 32)
    if type_name == "Q8_0":
        w = groups * _bf16(scale)[..., None]
    else:
        w = (groups - 8) * _bf16(scale)[..., None] + _bf16(offset + 8 * scale)[..., None]
    w = w.reshape(64, 512)
    assert torch.equal(unpacked_weight([(prepared[f"int4pack{i}"], prepared[f"scales_and_zeros{i}"])
                                        for i in range(planes)]), w.bfloat16())
    for tokens in (7, DEQUANTIZE_FROM_TOKENS):  # torch's int4 matmul; the weight unpacked to bf16 (prefill)
        x = torch.randn(tokens, 512).bfloat16()
        expected = x.float() @ w.t()
        y = kernel.apply(x, prepared, None).float()
        assert ((y - expected).norm() / expected.norm()) < 5e-3
    assert ((w - dequantize_blocks(qweight, type_name)).norm() / w.norm()) < 5e-3  # bf16 scales: close, not exact


def test_cpu_runs_float32_and_outputs_torch_cannot_pack_on_the_reference():
    platform = CpuPlatform()
    assert type(platform.quant_linear_kernel(scheme_for_type("Q4_1"), torch.float32)) is GgufReferenceKernel
    assert type(platform.quant_linear_kernel(scheme_for_type("Q6_K"), torch.float32)) is GgufReferenceKernel
    kernel = gguf_kernel(scheme_for_type("Q8_0"), torch.bfloat16, compiled=False)
    qweight = _blocks("Q8_0", 24, 64)  # 24 outputs: not a multiple of 16
    x = torch.randn(3, 64).bfloat16()
    prepared = kernel.prepare({"qweight": qweight})
    assert set(prepared) == {"qweight"}
    expected = F.linear(x, dequantize_blocks(qweight, "Q8_0", x.dtype))
    torch.testing.assert_close(kernel.apply(x, prepared, None), expected)


@pytest.mark.skipif(not quant_gemv_fits(), reason="the compiled quant kernel does not run here")
@pytest.mark.parametrize("type_name", PER_32)
def test_cpu_compiled_layout_holds_the_blocks_exact_values(type_name):
    """The compiled kernel's layout: its dequantized weights are the blocks' exactly (float32), it
    holds the blocks' bytes (Q4_K: float32 scales and offsets, 24 per 32 weights), and its
    products (1-8 rows: the kernel; 40: dequantized once) agree up to float32 sums and one
    bfloat16 rounding; 40 outputs (not 16k) run too."""
    scheme = scheme_for_type(type_name)
    kernel = gguf_kernel(scheme, torch.bfloat16, compiled=True)
    assert isinstance(kernel, CpuGgufCompiledKernel)
    for out in (64, 40):
        qweight = _blocks(type_name, out, 512)
        prepared = kernel.prepare({"qweight": qweight})
        w = dequantize_blocks(qweight, type_name)
        bits, zero = (8, 0) if type_name == "Q8_0" else (4, 8 if type_name == "Q4_0" else 0)
        assert torch.equal(cpu_quant_layout.dequantized_t(prepared, bits, zero).t(), w)
        held = sum(t.untyped_storage().nbytes() for t in prepared.values())
        assert held == CpuPlatform.quantized_weight_bytes(scheme, out, 512, "bfloat16")
        per_32 = {"Q4_K": 24}.get(type_name, GGML_TYPES[type_name].block_bytes)
        assert held == -(-out // 32) * 32 * 512 // 32 * per_32
        for tokens in (1, 3, 8, 40):
            x = torch.randn(tokens, 512).bfloat16()
            bias = torch.randn(out).bfloat16()
            expected = x.float() @ w.t() + bias.float()
            y = kernel.apply(x, prepared, bias).float()
            assert ((y - expected).norm() / expected.norm()) < 5e-3


def test_cpu_holds_q6_k_dequantized_once_in_bfloat16():
    """torch's int4 matmul takes no group of 16: Q6_K in bf16 is the dequantized weight, rounded once."""
    kernel = CpuPlatform().quant_linear_kernel(scheme_for_type("Q6_K"), torch.bfloat16)
    assert isinstance(kernel, CpuGgufDequantizedKernel)
    qweight = _blocks("Q6_K", 48, 512)
    prepared = kernel.prepare({"qweight": qweight})
    assert torch.equal(prepared["weight"], dequantize_blocks(qweight, "Q6_K").bfloat16())
    x = torch.randn(3, 512).bfloat16()
    torch.testing.assert_close(kernel.apply(x, prepared, None), F.linear(x, prepared["weight"]))
    assert CpuPlatform.quantized_weight_bytes(scheme_for_type("Q6_K"), 48, 512, "bfloat16") == 48 * 512 * 2


def test_config_section_gives_each_module_its_type():
    section = quantization_config("m.gguf", {"model.layers.0.mlp.down_proj": "Q4_K",
                                             "model.layers.0.mlp.up_proj": "Q4_1"})
    quant = detect_quantization({"quantization_config": section})
    assert quant.method == "gguf"
    assert quant.scheme_for("model.layers.0.mlp.down_proj") == scheme_for_type("Q4_K")
    assert quant.scheme_for("model.layers.0.mlp.up_proj").kernel == "gguf_q4_1"
    assert quant.scheme_for("lm_head") is None
    assert scheme_for_type("Q4_K").tensors[0].shape(1536, 512) == (1536, 2, 144)


def test_gguf_flag_on_a_folder_not_converted_from_a_gguf_says_to_pass_the_gguf():
    with pytest.raises(QuantizationError, match="pass the .gguf as --model"):
        detect_quantization({"model_type": "llama"}, "gguf")


def _write_gguf(path, tensors: dict[str, tuple[str, int, int]]) -> None:
    """A .gguf holding only ``tensors`` {name: (ggml type, rows, cols)}, zero bytes."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (type_name, rows, cols) in tensors.items():
        qtype = gguf.GGMLQuantizationType[type_name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        writer.add_tensor(name, np.zeros((rows, cols // block * size), np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_an_unsupported_type_names_the_tensor_the_supported_types_and_the_dequantized_way(tmp_path):
    path = tmp_path / "iq2.gguf"
    _write_gguf(path, {"blk.0.attn_q.weight": ("Q4_1", 256, 256), "blk.0.ffn_down.weight": ("IQ2_XXS", 256, 256)})
    with pytest.raises(QuantizationError) as err:
        convert_gguf(path, keep_quantized=True)  # refused before transformers reads the file
    message = str(err.value)
    assert "blk.0.ffn_down.weight is stored as IQ2_XXS" in message
    assert "Q8_0, Q4_0, Q4_1, Q4_K" in message
    assert "drop --quantization gguf to load the .gguf dequantized to --dtype" in message


def test_a_fused_layer_mixing_types_keeps_each_type_and_says_so(tmp_path, caplog):
    """llama.cpp's Q4_K_M: a Q6_K (here Q8_0) attn_v beside Q4_K q and k. Each keeps its type (the
    layer runs them as shards); a dense ffn_up beside a Q4_1 ffn_gate stays dense, the gate kept."""
    path = tmp_path / "mixed.gguf"
    _write_gguf(path, {"blk.3.attn_q.weight": ("Q4_K", 256, 256), "blk.3.attn_k.weight": ("Q4_K", 256, 256),
                       "blk.3.attn_v.weight": ("Q8_0", 256, 256), "blk.3.attn_output.weight": ("Q4_K", 256, 256),
                       "blk.3.ffn_gate.weight": ("Q4_1", 256, 256), "blk.3.ffn_up.weight": ("F32", 256, 256)})
    with caplog.at_level("INFO", logger="tengyun.models.gguf_quantized"):
        assert kept_types(path) == {"blk.3.attn_q.weight": "Q4_K", "blk.3.attn_k.weight": "Q4_K",
                                    "blk.3.attn_v.weight": "Q8_0", "blk.3.attn_output.weight": "Q4_K",
                                    "blk.3.ffn_gate.weight": "Q4_1"}
    assert "2 fused layer(s) mix ggml types (llama.cpp's Q4_K_M does); each module runs with its own" in caplog.text
    assert "blk.3.attn_v.weight Q8_0" in caplog.text and "blk.3.ffn_up.weight dense" in caplog.text


def test_moe_gate_and_up_mixing_types_load_dense(tmp_path, caplog):
    """FusedMoE stacks the experts' gate and up as one tensor: of one type, or dense."""
    path = tmp_path / "mixed_moe.gguf"
    _write_gguf(path, {"blk.0.ffn_gate_exps.weight": ("Q4_K", 256, 256), "blk.0.ffn_up_exps.weight": ("Q8_0", 256, 256),
                       "blk.0.ffn_down_exps.weight": ("Q8_0", 256, 256)})
    with caplog.at_level("INFO", logger="tengyun.models.gguf_quantized"):
        assert kept_types(path) == {"blk.0.ffn_down_exps.weight": "Q8_0"}
    assert "1 MoE layer(s) store experts' gate and up in different ggml types and load dense" in caplog.text


def test_q5_0_is_stored_as_q8_0_and_so_is_q4_0_fused_with_q8_0(tmp_path):
    path = tmp_path / "promoted.gguf"
    _write_gguf(path, {"blk.0.attn_q.weight": ("Q4_0", 64, 64), "blk.0.attn_k.weight": ("Q5_0", 64, 64),
                       "blk.0.attn_v.weight": ("Q8_0", 64, 64), "blk.0.attn_output.weight": ("Q4_0", 64, 64),
                       "blk.0.ffn_down.weight": ("Q5_0", 64, 64), "blk.0.ffn_up.weight": ("F32", 64, 64)})
    assert kept_types(path) == {"blk.0.attn_q.weight": "Q8_0", "blk.0.attn_k.weight": "Q8_0",
                                "blk.0.attn_v.weight": "Q8_0", "blk.0.attn_output.weight": "Q4_0",
                                "blk.0.ffn_down.weight": "Q8_0"}  # F32: a dense layer


def _plan(model, *flags):
    cli = [sys.executable, "-m", "tengyun.entrypoints.cli.main", "plan", str(model)]
    proc = subprocess.run([*cli, "--kv-cache-memory", "256MiB", "--max-model-len", "128", "--json", *flags],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_plan_of_the_gguf_kept_quantised_counts_its_blocks():
    """SmolLM2-135M: 30 layers of q, k, v, o (576 x 576, 2 x 192 x 576, 576 x 576) and gate, up,
    down (3 x 1536 x 576) in Q4_1 (20 bytes per 32 weights); token_embd (the tied LM head) in
    Q8_0; the norms dense."""
    linear = 30 * (2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576)
    vocab, norms = 49152 * 576, 61 * 576  # 2 norms per layer and the final one
    kept = _plan(smollm2_gguf(), "--quantization", "gguf", "--device", "npu", "--dtype", "bfloat16")
    assert kept["quantization"] == ("GGUF Q4_1 (4-bit blocks of 32, kept quantised); "
                                    "GGUF Q8_0 (8-bit blocks of 32, kept quantised)")
    # No NPU kernel streams the head's blocks: it and its tied embedding turn dense, one weight.
    assert kept["stages"][0]["weight_bytes"] == linear // 32 * 20 + 2 * (vocab + norms)
    # On CPU in bf16 the Q4_1 layers hold as much (torch's int4 layout: 16 bytes of nibbles + a
    # bf16 scale and zero per 32 weights; the compiled one: nibbles, fp16 scale and offset); the
    # head streams its Q8_0 blocks (32 int8 + a 2-byte scale per 32 weights in either layout, the
    # int4 one as two planes of nibbles), and where the compiled layout holds it (AVX512-BF16)
    # the tied embedding reads its rows there; else it keeps its blocks (34 bytes per 32).
    repacked = _plan(smollm2_gguf(), "--quantization", "gguf", "--device", "cpu", "--dtype", "bfloat16")
    compiled = CpuPlatform._compiled_quant_layout()
    head = vocab + vocab // 32 * 2 if compiled else 2 * (vocab // 2 + vocab // 32 * 2 * 2)
    embedding = 0 if compiled else vocab // 32 * 34
    assert repacked["stages"][0]["weight_bytes"] == linear // 32 * 20 + 2 * norms + head + embedding
    # float32: the reference kernel would dequantize the head at every step, so it turns dense.
    fp32 = _plan(smollm2_gguf(), "--quantization", "gguf", "--device", "cpu", "--dtype", "float32")
    head_copy = 4 * vocab if CpuPlatform.tied_head_copy("float32", 1) else 0
    assert fp32["stages"][0]["weight_bytes"] == linear // 32 * 20 + 4 * (vocab + norms) + head_copy
    assert _plan(smollm2_gguf(), "--device", "cpu", "--dtype", "bfloat16")["quantization"] is None


def test_serving_a_gguf_with_a_type_tengyun_cannot_keep_exits_2_naming_the_tensor(tmp_path):
    path = tmp_path / "iq2.gguf"
    _write_gguf(path, {"blk.0.ffn_down.weight": ("IQ2_XXS", 256, 256)})
    proc = subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "generate", "Hello", str(path),
                           "--quantization", "gguf"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    assert "blk.0.ffn_down.weight is stored as IQ2_XXS, which Tengyun cannot keep quantised" in proc.stderr
    assert "drop --quantization gguf to load the .gguf dequantized" in proc.stderr


def assert_read_as_transformers_reads(monkeypatch, gguf_file, keep_quantized: bool) -> dict | None:
    """model_source._read_tensors on ``gguf_file`` against transformers' own full load
    (load_gguf_checkpoint with every tensor in float32, read here as the reference): the streamed
    read calls the loader without tensors, gives the same names (a kept ``module.qweight`` for
    ``module.weight``; a kept expert's blocks for its slice of experts.gate_up_proj / down_proj) and
    the same float32 values, kept blocks dequantizing to them exactly. -> ``kept``."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    from tengyun.models import gguf_quantized, model_source

    with shared_readers():  # the header parsed once for all these loaders, as in a conversion
        config = model_source._gguf_config(AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name),
                                           gguf_file)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        full = hf_gguf.load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton,
                                            torch_dtype=torch.float32)["tensors"]
        calls = []
        real_load = hf_gguf.load_gguf_checkpoint
        monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", lambda *a, **k: calls.append(k["return_tensors"])
                            or real_load(*a, **k))
        kept = {} if keep_quantized else None
        streamed = dict(model_source._read_tensors(gguf_file, skeleton, kept))
    assert calls == [False]
    assert {gguf_quantized.skeleton_name(name) for name in streamed} == set(full)
    for name, tensor in streamed.items():
        expected = full[gguf_quantized.skeleton_name(name)]
        if name.endswith(".qweight"):
            expected = _expert_slice(name, expected)
            module = name.removesuffix(".qweight")
            type_name = kept.get(module) or kept[re.sub(r"experts\.\d+\.", "experts.0.", module)]  # by expert 0
            tensor = dequantize_blocks(tensor, type_name)
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected), name
    return kept


def _expert_slice(name: str, stack: torch.Tensor) -> torch.Tensor:
    """A kept expert's dense weight in transformers' stack ([E, 2I, H]: gate rows, then up)."""
    expert = re.search(r"experts\.(\d+)\.(gate|up|down)_proj", name)
    if expert is None:
        return stack
    weight = stack[int(expert.group(1))]
    half = weight.shape[0] // 2
    return {"gate": weight[:half], "up": weight[half:], "down": weight}[expert.group(2)]


@pytest.mark.parametrize("keep_quantized", [True, False])
def test_a_dense_gguf_is_read_tensor_by_tensor_as_the_full_load_reads_it(monkeypatch, keep_quantized):
    """SmolLM2's .gguf, kept quantised or dequantized, read one tensor at a time gives what
    transformers' full load gives (Llama's q/k rows permuted by transformers' processor, a tied
    head; Qwen2.5-Coder's streamed conversion is checked against HF's tokens in test_gguf_real.py)."""
    from tengyun.models import gguf_quantized

    gguf_file = smollm2_gguf()
    kept = assert_read_as_transformers_reads(monkeypatch, gguf_file, keep_quantized)
    if keep_quantized:
        assert kept["model.layers.0.self_attn.q_proj"] == "Q4_1"
        assert gguf_quantized.kept_section(gguf_file, kept)["quant_method"] == "gguf"
