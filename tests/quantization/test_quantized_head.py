"""An untied LM head stored quantised in a compressed-tensors folder, targeted by name (as vLLM's
ParallelLMHead is matched since vLLM 0.18; "Linear" targets do not reach it), and `tengyun
quantize --quantize-lm-head`, which writes one: W8A8 in the decoder's group, W4A16's head as W8A16
per channel in a group of its own. Tokens against HF's on the dequantized fp32 twin (weight-only:
exact), W8A8 logprobs against HF with the same activation rounding (the head's input rounded
too); in bfloat16 the head runs the compiled kernel on its int8 weights and holds no dense copy;
TP=2 splits its rows; `tengyun plan` counts what the worker holds; a tied model is untied, its head
quantised from the embedding."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_quantized_models import (
    MAX_TOKENS, W8A8_LOGPROB_TOLERANCE, _activation_rounding, _hf_greedy, _prompts, _tengyun, dequantized_twin,
    planned_and_held_bytes,
)

from tengyun import LLM, SamplingParams
from tengyun.platforms.cpu.kernels.quant import CpuInt8WeightOnlyKernel, CpuW8A8Kernel
from tengyun.platforms.cpu.kernels.quant_layout import quant_gemv_fits
from tengyun.quantization.config import detect_quantization
from tengyun.ops.quantize import quantize_folder
from tengyun.worker.worker import weight_bytes


@pytest.fixture(scope="module")
def with_head(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("quantized_head")
    folders = {}
    for arch in ("llama", "qwen3"):  # both untied
        for scheme in ("w4a16", "w8a8"):
            q = quantize_folder(tiny_checkpoints[arch], out / f"{arch}_{scheme}", scheme, 32, head=True).out_dir
            folders[arch, scheme] = (q, dequantized_twin(q, out / f"{arch}_{scheme}_twin"))
    return folders


def test_the_folder_targets_the_head_by_name_and_no_longer_ignores_it(with_head):
    for scheme, head_bits in (("w4a16", 8), ("w8a8", 8)):
        folder, _ = with_head["llama", scheme]
        config = json.loads((folder / "config.json").read_text())
        section = config["quantization_config"]
        assert "lm_head" not in section["ignore"]
        tensors = load_file(folder / "model.safetensors")
        quant = detect_quantization(config)
        head = quant.head_scheme("lm_head")
        assert head is not None and head.weight_bits == head_bits and quant.scheme_for("lm_head") is not None
        if scheme == "w4a16":
            assert section["config_groups"]["group_1"]["targets"] == ["lm_head"]
            assert head.group_size is None and tensors["lm_head.weight_packed"].shape == (384, 64 * 8 // 32)
        else:
            assert section["config_groups"]["group_0"]["targets"] == ["Linear", "lm_head"]
            assert tensors["lm_head.weight"].dtype == torch.int8
        assert "lm_head.weight" not in tensors or scheme == "w8a8"


def test_linear_targets_do_not_reach_the_head_without_its_name():
    config = {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": [],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}}
    quant = detect_quantization(config)
    assert quant.scheme_for("model.layers.0.mlp.down_proj") is not None and quant.head_scheme("lm_head") is None
    config["quantization_config"]["config_groups"]["group_0"]["targets"] = ["Linear", "re:.*lm_head$"]
    assert detect_quantization(config).head_scheme("lm_head") is not None
    config["quantization_config"]["ignore"] = ["lm_head"]
    assert detect_quantization(config).head_scheme("lm_head") is None


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_w4a16_with_an_8_bit_head_gives_hf_tokens_on_the_twin(with_head, arch):
    folder, twin = with_head[arch, "w4a16"]
    assert [o.token_ids for o in _tengyun(folder)] == _hf_greedy(twin, _prompts())


def _hf_logprobs_head_rounded(twin, prompt, tokens):
    """HF on the twin, every decoder linear's input and the head's rounded as W8A8 rounds them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (name.startswith("model.layers.") or name == "lm_head"):
            module.row_parallel = False
            module.register_forward_pre_hook(_activation_rounding(1))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def test_w8a8_head_logprobs_match_hf_rounding_the_heads_input_too(with_head):
    folder, twin = with_head["llama", "w8a8"]
    worst = 0.0
    for prompt, out in zip(_prompts(), _tengyun(folder)):
        ours = [out.logprobs[i][token].logprob for i, token in enumerate(out.token_ids)]
        worst = max(worst, *(abs(a - b) for a, b in zip(ours, _hf_logprobs_head_rounded(twin, prompt, out.token_ids))))
    assert worst < W8A8_LOGPROB_TOLERANCE


def _bf16_engine(folder):
    llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    try:
        outs = [o.outputs[0] for o in llm.generate(_prompts(), params)]
        return outs, llm.llm_engine.executor.model
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.skipif(not quant_gemv_fits(), reason="the compiled quant kernel does not run on this CPU")
def test_in_bfloat16_the_head_runs_its_kernel_on_the_int8_weights_and_answers_as_a_dense_head(with_head):
    """The W8A16 head through the compiled 8-bit kernel, no dense copy held; its logits against
    the dequantized weight multiplied densely in float64 within one bfloat16 rounding (past the
    kernel's row limit this small head is dequantized to bfloat16 per call: that weight); the W8A8
    head through its int8 kernel."""
    folder, twin = with_head["llama", "w4a16"]
    outs, model = _bf16_engine(folder)
    head = model.lm_head
    assert isinstance(head.kernel, CpuInt8WeightOnlyKernel) and "qpacked" in head.kernel_weight
    assert head.weight_packed.numel() == 0 and not hasattr(head, "weight")
    assert weight_bytes(head) == sum(t.untyped_storage().nbytes() for t in head.kernel_weight.values())
    dense = load_file(twin / "model.safetensors")["lm_head.weight"].double()
    x = torch.randn(1, dense.shape[1]).bfloat16()
    torch.testing.assert_close(head.compute_logits(x).double(), x.double() @ dense.t(), rtol=2 ** -7, atol=1e-2)
    weight = dense.bfloat16().double()
    for seed in range(6):  # its own generator: the engine's sampling leaves the global one anywhere
        x = torch.randn(40, dense.shape[1], generator=torch.Generator().manual_seed(seed)).bfloat16().double()
        error = (head.compute_logits(x.bfloat16()).double() - x @ weight.t()).abs()
        # bfloat16 products summed in float32, the sum rounded to bfloat16: a few 2^-8 of the
        # terms' magnitudes per logit (a flat atol failed logits near 0 from cancelling terms)
        bound = 2 ** -6 * (x.abs() @ weight.abs().t())
        assert (error <= bound).all(), f"seed {seed}: worst {(error / bound).max():.2f} of the bound"
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    _, w8a8_model = _bf16_engine(with_head["llama", "w8a8"][0])
    assert isinstance(w8a8_model.lm_head.kernel, CpuW8A8Kernel) and w8a8_model.lm_head.scheme is not None


def test_tp2_splits_the_heads_rows_and_gives_the_single_process_tokens(with_head):
    folder, _ = with_head["qwen3", "w4a16"]
    assert [o.token_ids for o in _tengyun(folder, tensor_parallel_size=2)] == \
        [o.token_ids for o in _tengyun(folder)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_counts_the_quantised_head_as_the_worker_holds_it(with_head, tiny_checkpoints, tmp_path, dtype):
    """float32: the weight-only head turns dense at bind (no kernel streams it); bfloat16: the
    compiled layout. The W4A16 folder without the head holds more in bfloat16."""
    def held(folder):
        planned, held_bytes = planned_and_held_bytes(folder, dtype)
        assert planned == held_bytes
        return held_bytes

    with_quantised_head = held(with_head["llama", "w4a16"][0])
    without = held(quantize_folder(tiny_checkpoints["llama"], tmp_path / "no_head", "w4a16", 32).out_dir)
    assert (with_quantised_head < without) == (dtype == "bfloat16" and quant_gemv_fits())


def test_quantize_lm_head_unties_a_tied_model_and_gives_hf_tokens_on_the_twin(tiny_checkpoints, tmp_path):
    """A tied model's head is quantised from the embedding into lm_head, the embedding stays as
    stored for the lookups, and config.json unties them (what vLLM then loads as an untied head)."""
    source = tiny_checkpoints["qwen2"]
    assert json.loads((source / "config.json").read_text())["tie_word_embeddings"] is True
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "quantize", str(source), str(out),
                           "--scheme", "w4a16", "--group-size", "32", "--quantize-lm-head"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and "lm_head" not in config["quantization_config"]["ignore"]
    tensors, stored = load_file(out / "model.safetensors"), load_file(source / "model.safetensors")
    assert "lm_head.weight" not in stored and torch.equal(tensors["model.embed_tokens.weight"],
                                                          stored["model.embed_tokens.weight"])
    assert tensors["lm_head.weight_packed"].shape == (stored["model.embed_tokens.weight"].shape[0], 64 * 8 // 32)
    assert detect_quantization(config).head_scheme("lm_head").weight_bits == 8
    twin = dequantized_twin(out, tmp_path / "twin")
    assert [o.token_ids for o in _tengyun(out)] == _hf_greedy(twin, _prompts())


def test_quantize_lm_head_on_an_untied_checkpoint_without_its_head_names_the_tensor(tiny_checkpoints, tmp_path):
    from safetensors.torch import save_file

    source = tmp_path / "headless"
    shutil.copytree(tiny_checkpoints["llama"], source)
    tensors = load_file(source / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, str(source / "model.safetensors"))
    with pytest.raises(ValueError, match="hold no lm_head.weight"):
        quantize_folder(source, tmp_path / "out", "w4a16", 32, head=True)
    assert not (tmp_path / "out").exists()
