"""`tengyun quantize` on Qwen3.5, Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet + gated attention
layers, MoE experts and a shared expert; Qwen3-Next's fused in_proj_qkvz quantised and split by
rows at load), end to end on tiny random fp32 checkpoints: W4A16 greedy tokens equal HF's on the
dequantized fp32 twin, W8A8 logprobs within the stated tolerance of HF with the same activation
rounding, TP=2 over gloo gives the single process's tokens, and the multimodal layout (vision
tower, model.language_model.*) quantises and serves as the text-only one."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from awq_gptq_layouts import Format, write_checkpoint
from conftest import QWEN3_5_TEXT, QWEN3_NEXT, make_tiny_qwen3_5, randomize_norms_and_routers
from test_quantized_models import (W8A8_LOGPROB_TOLERANCE, _hf_greedy, _hf_logprobs, _prompts, _tengyun,
                                   dequantized_twin)
from tengyun.ops.quantize import HYBRID_IGNORE, quantize_folder

# Linear-attention value heads of 16 (Hv * Dv = 64), so that out_proj's input splits in two
# 32-wide halves at TP=2 (group 32); a shared expert as wide as a group multiple.
SIZES = dict(linear_value_head_dim=16, shared_expert_intermediate_size=64)
# HF's chunked gated delta rule sums the 40-token prompt in another order than Tengyun does: a
# value on a rounding boundary of the next layer's activation quantisation can flip (measured
# 0.008; with float activations HF drifts from W8A8 by up to 0.08). The 4- and 17-token prompts
# stay within W8A8_LOGPROB_TOLERANCE (measured 1e-6; float activations: up to 0.056).
W8A8_LONG_PROMPT_TOLERANCE = 0.02


def _tiny_model(arch):
    if arch == "qwen3_next":
        import transformers

        config = transformers.Qwen3NextConfig(**{**QWEN3_NEXT, **SIZES})
        return randomize_norms_and_routers(transformers.Qwen3NextForCausalLM(config)).eval()
    return make_tiny_qwen3_5(arch, **(SIZES if arch == "qwen3_5_moe" else dict(linear_value_head_dim=16)))


def _save(model, folder, tokenizer_dir):
    model.save_pretrained(folder)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, tiny_tokenizer_dir):
    """{(arch, scheme): (quantised folder, its dequantized fp32 twin)}."""
    root = tmp_path_factory.mktemp("quantized_hybrid")
    folders = {}
    for arch in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        source = _save(_tiny_model(arch), root / arch, tiny_tokenizer_dir)
        for scheme in ("w4a16", "w8a8") if arch == "qwen3_5" else ("w4a16",):
            q = quantize_folder(source, root / f"{arch}_{scheme}", scheme, 32).out_dir
            folders[arch, scheme] = (q, dequantized_twin(q, root / f"{arch}_{scheme}_twin"))
    return folders


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_w4a16_greedy_equals_hf_on_the_dequantized_twin(hybrid, arch):
    folder, twin = hybrid[arch, "w4a16"]
    assert [o.token_ids for o in _tengyun(folder)] == _hf_greedy(twin, _prompts())


def test_quantize_keeps_the_small_gates_and_writes_them_to_the_ignore_list(hybrid):
    folder, _ = hybrid["qwen3_5_moe", "w4a16"]
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == ["lm_head", "re:.*mlp.gate$", *HYBRID_IGNORE]
    with safe_open(folder / "model.safetensors", framework="pt") as reader:
        names = set(reader.keys())
    layer = "model.layers.0"
    for kept in ("linear_attn.in_proj_a", "linear_attn.in_proj_b", "mlp.shared_expert_gate", "mlp.gate"):
        assert f"{layer}.{kept}.weight" in names
    for packed in ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj",
                   "mlp.experts.7.down_proj", "mlp.shared_expert.up_proj"):
        assert f"{layer}.{packed}.weight_packed" in names
    assert "model.layers.3.self_attn.q_proj.weight_packed" in names  # the full-attention layer


def test_w8a8_logprobs_match_hf_with_the_same_activation_rounding(hybrid):
    """Qwen3.5 (dense MLP: HF's experts are not nn.Linear layers a hook could round) against HF on
    the dequantized twin, rounding the inputs of the layers the folder quantised."""
    folder, twin = hybrid["qwen3_5", "w8a8"]
    ignore = json.loads((folder / "config.json").read_text())["quantization_config"]["ignore"]
    worst = []
    for prompt, out in zip(_prompts(), _tengyun(folder)):
        ours = [out.logprobs[i][token].logprob for i, token in enumerate(out.token_ids)]
        simulated = _hf_logprobs(twin, prompt, list(out.token_ids), quantize_activations=True, ignore=ignore)
        worst.append(max(abs(a - b) for a, b in zip(ours, simulated)))
    print(f"W8A8 qwen3_5: max |logprob - HF simulated| per prompt {[f'{w:.1e}' for w in worst]}")
    assert max(worst[:2]) < W8A8_LOGPROB_TOLERANCE and worst[2] < W8A8_LONG_PROMPT_TOLERANCE


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_w4a16_tp2_over_gloo_gives_the_single_process_tokens(hybrid, arch):
    """Each rank holds half the experts' packed rows, half of in_proj_qkv's q, k and v heads and
    half of out_proj's input groups."""
    folder, _ = hybrid[arch, "w4a16"]
    single = [o.token_ids for o in _tengyun(folder)]
    assert [o.token_ids for o in _tengyun(folder, tensor_parallel_size=2)] == single


def test_the_multimodal_layout_quantises_and_serves_as_the_text_only_one(hybrid, tiny_tokenizer_dir, tmp_path):
    """Qwen3_5ForConditionalGeneration: model.language_model.layers.* quantised, the vision tower
    copied as stored (and ignored by name, as vLLM builds it), the same tokens as the text layout;
    also with the ignore list spelled out module by module in the checkpoint's names, as
    llm-compressor writes it (read as Tengyun's text model names them)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = make_tiny_qwen3_5("qwen3_5", linear_value_head_dim=16)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config={**QWEN3_5_TEXT, "linear_value_head_dim": 16},
                                                          vision_config=vision))
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    source = _save(model, tmp_path / "mm", tiny_tokenizer_dir)
    folder = quantize_folder(source, tmp_path / "mm_w4a16", "w4a16", 32).out_dir
    with safe_open(folder / "model.safetensors", framework="pt") as reader:
        names = set(reader.keys())
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight_packed" in names
    assert "model.visual.blocks.0.attn.qkv.weight" in names
    expected = [o.token_ids for o in _tengyun(hybrid["qwen3_5", "w4a16"][0])]
    assert [o.token_ids for o in _tengyun(folder)] == expected
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*visual.*"] + [
        f"model.language_model.layers.{layer}.linear_attn.in_proj_{p}" for layer in range(3) for p in "ab"]
    config_file.write_text(json.dumps(config))
    assert [o.token_ids for o in _tengyun(folder)] == expected


# The Gated DeltaNet's one-row-per-head gates stay dense, as GPTQModel's Qwen3-Next releases keep them.
_NEXT_DENSE = (("-:.*in_proj_ba$", {}), ("-:.*shared_expert_gate$", {}))
_NEXT_FORMATS = {"awq": Format("awq", group=32, dynamic=_NEXT_DENSE),
                 "gptq4_act_order": Format("gptq", bits=4, desc_act=True, dynamic=_NEXT_DENSE),
                 "gptq8_sym_v2": Format("gptq", bits=8, sym=True, checkpoint_format="gptq_v2", dynamic=_NEXT_DENSE)}


def _next_linear(name, tensor) -> bool:
    return tensor.dim() == 2 and name.startswith("model.layers.") and name.endswith(("_proj.weight", "_qkvz.weight"))


@pytest.fixture(scope="module")
def next_awq_gptq(hybrid, tmp_path_factory):
    """{case: (Qwen3-Next folder with in_proj_qkvz, out_proj, attention and MLPs in AWQ / GPTQ, its twin)}."""
    root, source = tmp_path_factory.mktemp("next_awq_gptq"), hybrid["qwen3_next", "w4a16"][1]
    folders = {}
    for case, fmt in _NEXT_FORMATS.items():
        folders[case] = write_checkpoint(source, root / case, root / f"{case}_twin", fmt, quantized=_next_linear)
        if fmt.method == "awq":  # AutoAWQ names what it left dense
            config_file = root / case / "config.json"
            config = json.loads(config_file.read_text())
            config["quantization_config"]["modules_to_not_convert"] = ["in_proj_ba", "shared_expert_gate"]
            config_file.write_text(json.dumps(config))
    return folders


@pytest.mark.parametrize("case", list(_NEXT_FORMATS))
def test_qwen3_next_awq_gptq_fused_projection_splits_by_columns(next_awq_gptq, case):
    """AWQ / GPTQ store in_proj_qkvz's outputs as columns (zero points packed 8 or 4 to a word
    along them): split per key head at load, greedy tokens equal HF's on the dequantized twin."""
    folder, twin = next_awq_gptq[case]
    assert "model.layers.0.linear_attn.in_proj_qkvz.qweight" in load_file(folder / "model.safetensors")
    assert [o.token_ids for o in _tengyun(folder)] == _hf_greedy(twin, _prompts())


def test_qwen3_next_awq_gptq_tp2_over_gloo_gives_the_single_process_tokens(next_awq_gptq):
    folder, _ = next_awq_gptq["gptq4_act_order"]
    assert [o.token_ids for o in _tengyun(folder, tensor_parallel_size=2)] == \
        [o.token_ids for o in _tengyun(folder)]


def test_qwen3_next_fused_projection_that_packs_across_a_head_names_the_tensor(hybrid, tmp_path):
    """A packed word that would straddle two key heads' segments cannot be split: start-up stops
    naming the tensor and what to do."""
    folder = shutil.copytree(hybrid["qwen3_next", "w4a16"][0], tmp_path / "straddling")
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.linear_attn.in_proj_qkvz"
    packed = tensors.pop(f"{name}.weight_packed")  # [160, 8] int32: as qzeros, 16 outputs a word
    tensors[f"{name}.qzeros"] = packed[:10].t().contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{name}\.qzeros packs 16 outputs to a word, which does not divide "
                                         r"the per-head segments \[8, 32\].*keep this projection unquantised"):
        _tengyun(folder)
