"""Ascend msModelSlim checkpoints (quant_model_description.json, tengyun/quantization/modelslim.py)
end to end on tiny random Llama and Qwen2 models written in its published layout
(modelslim_checkpoints.py): W8A8_DYNAMIC and static W8A8 logprobs within a stated tolerance of
HF on the fp32 twin with the same activation rounding simulated, the NPU kernels (torch_npu
stand-in) giving the CPU kernels' tokens, and descriptions or weights Tengyun cannot run
refused with exit 2 naming the tensor."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from modelslim_checkpoints import input_quantization, write_modelslim
from safetensors.torch import load_file, save_file
from test_quantized_models import _fake_quantize, _prompts, _tengyun

from tengyun import LLM, SamplingParams
from tengyun.quantization.config import QuantizationError, detect_quantization
from tengyun.quantization.modelslim import from_folder

# Each token's logprob under Tengyun stays within this of HF's on the dequantized twin with the
# same activation rounding done in float (int32 vs float sums; static W8A8 also rounds bias /
# deq_scale into quant_bias). Measured <= 3e-6 for W8A8_DYNAMIC.
MODELSLIM_LOGPROB_TOLERANCE = 1e-3
# Static W8A8 rounds a whole layer input with one scale, so an activation that Tengyun and HF
# compute 1e-7 apart (float32) on either side of a rounding boundary moves by a whole quantum: on
# the tiny Llama a layer-1 MLP input lies 1e-5 quanta from one, and the tokens after it drift by up
# to 0.037. Most positions stay exact (STATIC_EXACT_SHARE of them within 1e-4).
STATIC_LOGPROB_TOLERANCE = 0.05
STATIC_EXACT_SHARE = 0.8


@pytest.fixture(scope="module")
def modelslim(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("modelslim")
    return {(arch, kind): write_modelslim(tiny_checkpoints[arch], out / arch, kind)
            for arch in ("llama", "qwen2") for kind in ("W8A8_DYNAMIC", "W8A8")}


def _static_rounding(scale: float, offset: float):
    """x -> (x_q - offset) * scale, x_q = round(x * (1 / scale) + offset) (the reciprocal, as
    npu_quantize with div_mode False and Tengyun's kernels: x / scale rounds a few values the other way)."""
    reciprocal = 1.0 / torch.tensor([scale])

    def hook(module, args):
        x_q = torch.clamp(torch.round(args[0] * reciprocal + offset), -128, 127)
        return ((x_q - offset) * scale,)
    return hook


def _hf_logprobs(twin, prompt, tokens, static: dict[str, tuple[float, float]] | None):
    """log p(tokens[i] | prompt + tokens[:i]) under HF on the twin, teacher-forced, every decoder
    linear layer's input rounded as Tengyun's kernel rounds it: per token (W8A8_DYNAMIC) or with
    the layer's input_scale / input_offset (``static``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            module.register_forward_pre_hook(
                _static_rounding(*static[name]) if static else lambda m, args: (_fake_quantize(args[0]),))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def _logprob_gaps(folder, twin, static: bool) -> list[float]:
    rounding = input_quantization(folder) if static else None
    gaps = []
    for prompt, out in zip(_prompts(), _tengyun(folder)):
        ours = [out.logprobs[i][token].logprob for i, token in enumerate(out.token_ids)]
        theirs = _hf_logprobs(twin, prompt, list(out.token_ids), rounding)
        gaps += [abs(a - b) for a, b in zip(ours, theirs)]
    return gaps


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases (static: folded into quant_bias)
@pytest.mark.parametrize("kind", ["W8A8_DYNAMIC", "W8A8"])
def test_modelslim_logprobs_match_hf_with_the_same_activation_rounding(modelslim, arch, kind):
    folder, twin = modelslim[arch, kind]
    gaps = _logprob_gaps(folder, twin, static=kind == "W8A8")
    exact = sum(gap < 1e-4 for gap in gaps) / len(gaps)
    print(f"ModelSlim {kind} {arch}: max |logprob - HF simulated| {max(gaps):.2e}, {exact:.0%} within 1e-4")
    if kind == "W8A8":
        assert max(gaps) < STATIC_LOGPROB_TOLERANCE and exact >= STATIC_EXACT_SHARE
    else:
        assert max(gaps) < MODELSLIM_LOGPROB_TOLERANCE


def test_int64_deq_scale_of_a_float16_export_gives_the_float32_tokens(tiny_checkpoints, modelslim, tmp_path):
    """msModelSlim stores deq_scale as int64 (the float32's bits) for float16 models."""
    folder, _ = write_modelslim(tiny_checkpoints["qwen2"], tmp_path, "W8A8", deq_scale_int64=True)
    assert load_file(folder / "model.safetensors")["model.layers.0.mlp.up_proj.deq_scale"].dtype == torch.int64
    assert [o.token_ids for o in _tengyun(folder)] == [o.token_ids for o in _tengyun(modelslim["qwen2", "W8A8"][0])]


# float16 dynamic: float32 weight scales with pertoken_scale. Not float16 static: there deq_scale goes
# through npu_trans_quant_param's encoding (a float32's top 19 bits, float16 precision), which the CPU
# reference does not round to, and this tiny random model's greedy tokens part within 6 steps.
@pytest.mark.parametrize("dtype, kind", [("bfloat16", "W8A8_DYNAMIC"), ("float16", "W8A8_DYNAMIC"),
                                         ("bfloat16", "W8A8")])
def test_npu_kernels_give_the_cpu_kernels_tokens(modelslim, monkeypatch, dtype, kind):
    """W8A8_DYNAMIC through npu_dynamic_quant + npu_quant_matmul, static W8A8 through npu_quantize +
    npu_quant_matmul (tengyun/platforms/npu/kernels/quant.py), against a CPU stand-in as strict as
    the torch_npu docs (16-bit activations only). In 16 bits the static export's float32
    input_scale, shared by the fused q/k/v and gate/up layers, loads (compared as the layer holds it)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "platforms"))
    import fake_torch_npu

    from tengyun.platforms.cpu.platform import CpuPlatform
    from tengyun.platforms.npu.kernels.quant import npu_quant_kernel

    prompts, params = [[5, 6, 7], list(range(1, 40))], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    args = dict(block_size=128, max_model_len=64, kv_cache_memory="1MiB", dtype=dtype)
    folder = str(modelslim["qwen2", kind][0])
    reference = [o.outputs[0].token_ids for o in LLM(folder, **args).generate(prompts, params)]
    fake = fake_torch_npu.module()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(CpuPlatform, "quant_linear_kernel", lambda self, scheme, dtype: npu_quant_kernel(scheme))
    assert [o.outputs[0].token_ids for o in LLM(folder, **args).generate(prompts, params)] == reference
    quantize = "npu_dynamic_quant" if kind == "W8A8_DYNAMIC" else "npu_quantize"
    assert fake.calls[quantize] == fake.calls["npu_quant_matmul"] > 0


def test_description_file_is_detected_and_forcing_ascend_needs_it(modelslim, tiny_checkpoints):
    folder = modelslim["llama", "W8A8"][0]
    config = json.loads((folder / "config.json").read_text())
    quant = detect_quantization(config, None, folder)
    assert quant.method == "ascend" and quant.kernels == ("w8a8_static_int8",)
    assert quant.describe() == "ModelSlim W8A8 (int8 per-channel weights, static per-tensor int8 activations)"
    assert quant.scheme_for("model.layers.1.mlp.down_proj") and quant.scheme_for("lm_head") is None
    assert detect_quantization(config, "ascend", folder).groups == quant.groups
    with pytest.raises(QuantizationError, match=r"--quantization ascend \(msModelSlim\) needs "
                                                r"quant_model_description\.json in the model folder"):
        detect_quantization(config, "ascend", tiny_checkpoints["llama"])


def _copy_with(folder: Path, tmp_path: Path, description=None, drop: str | None = None) -> Path:
    copy = shutil.copytree(folder, tmp_path / "changed")
    if description:
        path = copy / "quant_model_description.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **description}))
    if drop:
        tensors = load_file(copy / "model.safetensors")
        del tensors[drop]
        save_file(tensors, str(copy / "model.safetensors"))
    return copy


def test_unsupported_types_and_quantised_attention_are_refused_naming_them(modelslim, tmp_path):
    folder = _copy_with(modelslim["llama", "W8A8_DYNAMIC"][0], tmp_path,
                        {"model.layers.1.mlp.down_proj.weight": "W4A8_DYNAMIC"})
    with pytest.raises(QuantizationError, match=r"says model\.layers\.1\.mlp\.down_proj\.weight is 'W4A8_DYNAMIC', "
                                                r"which Tengyun does not run; it reads msModelSlim W8A8_DYNAMIC, W8A8"):
        from_folder(folder)
    shutil.rmtree(folder)
    folder = _copy_with(modelslim["llama", "W8A8"][0], tmp_path, {"fa_quant_type": "FAQuant"})
    with pytest.raises(QuantizationError, match="sets fa_quant_type 'FAQuant': Tengyun does not run quantised"):
        from_folder(folder)


def _generate_cli(folder) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "generate", "Hello", str(folder),
                           "--max-tokens", "2", "--kv-cache-memory", "1MiB"], capture_output=True, text=True,
                          timeout=300)


def test_a_missing_weight_scale_exits_2_naming_the_tensor(modelslim, tmp_path):
    folder = _copy_with(modelslim["qwen2", "W8A8_DYNAMIC"][0], tmp_path,
                        drop="model.layers.0.self_attn.k_proj.weight_scale")
    proc = _generate_cli(folder)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert ("checkpoint tensor model.layers.0.self_attn.k_proj.weight_scale is missing from" in last
            and "says model.layers.0.self_attn.k_proj.weight is W8A8_DYNAMIC, which stores weight, weight_scale, "
                "weight_offset" in last), last


def _planned_weights(folder: Path) -> int:
    proc = subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "plan", str(folder), "--device", "cpu",
                           "--dtype", "float32", "--kv-cache-memory", "1MiB", "--max-model-len", "128", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    return plan["quantization"], plan["stages"][0]["weight_bytes"]


def _stored(folder: Path, suffixes: tuple[str, ...] = ("",)) -> int:
    return sum(t.numel() * t.element_size() for name, t in load_file(folder / "model.safetensors").items()
               if name.endswith(suffixes))


def test_plan_counts_the_stored_bytes(modelslim, tiny_checkpoints):
    """fp32 model, every tensor stored in the dtype Tengyun holds it in: the plan grows or shrinks
    from the dense model's by exactly the checkpoint's bytes (int8 weights, scales, offsets,
    deq_scale, quant_bias; the plan also counts CPU's packed copy of the tied LM head where the
    embedding keeps its own), less
    the static input_scale / input_offset pairs the checkpoint repeats per projection that a
    fused layer holds once (q/k/v and gate/up see one input): 3 pairs of float32 per layer; and
    where CPU packs W8A8 weights (AVX-512 VNNI), the per-output tensors its kernel does not read:
    weight_offset (all zero), and static W8A8's weight_scale (deq_scale holds the product)."""

    dense = tiny_checkpoints["qwen2"]
    quantization, dense_planned = _planned_weights(dense)
    assert quantization is None
    from tengyun.platforms.cpu.kernels.quant import w8a8_packed_fits

    packs = w8a8_packed_fits()
    for kind in ("W8A8_DYNAMIC", "W8A8"):
        folder = modelslim["qwen2", kind][0]
        quantization, planned = _planned_weights(folder)
        assert quantization.startswith(f"ModelSlim {kind} ")
        repeated = 2 * 3 * 2 * 4 if kind == "W8A8" else 0  # 2 layers x 3 pairs x 2 float32
        unread = (".weight_offset",) if kind == "W8A8_DYNAMIC" else (".weight_offset", ".weight_scale")
        dropped = _stored(folder, unread) if packs else 0
        assert planned - dense_planned == _stored(folder) - repeated - dropped - _stored(dense)


def test_static_kernels_agree_and_read_int64_deq_scales(monkeypatch):
    """CPU (torch._int_mm) and the reference give the same outputs; int64 deq_scale holds the
    float32's bits (0x3C000000 -> 2^-7); static W8A8 refuses to split under tensor parallelism."""
    from tengyun.layers import quant_kernels
    from tengyun.platforms.cpu.kernels.quant import CpuW8A8StaticKernel
    from tengyun.quantization.modelslim import static_scheme

    assert quant_kernels.deq_scale_float32(torch.tensor([0x3C000000], dtype=torch.int64)).item() == 2.0 ** -7
    torch.manual_seed(0)
    tensors = {"weight": torch.randint(-128, 128, (48, 64), dtype=torch.int8),
               "weight_scale": torch.rand(48, 1), "weight_offset": torch.zeros(48, 1),
               "input_scale": torch.tensor([0.02]), "input_offset": torch.tensor([-3.0]),
               "deq_scale": torch.rand(48) * 1e-3, "quant_bias": torch.randint(-5000, 5000, (48,), dtype=torch.int32)}
    x = torch.randn(2, 5, 64)
    reference = quant_kernels.ReferenceW8A8StaticKernel(static_scheme())
    cpu = CpuW8A8StaticKernel(static_scheme())
    assert torch.equal(cpu.apply(x, cpu.prepare(tensors), None), reference.apply(x, reference.prepare(tensors), None))
    monkeypatch.setattr(quant_kernels, "get_tp_size", lambda: 2)
    with pytest.raises(ValueError, match="static W8A8 .* runs at --tensor-parallel-size 1"):
        cpu.prepare(tensors)
