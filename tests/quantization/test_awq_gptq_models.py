"""AWQ GEMM and GPTQ checkpoints end to end on tiny random models (fp32), written from the public
layouts by awq_gptq_layouts.py (cross-checked against AutoAWQ's and GPTQModel's dequantizers by
third_party_awq_gptq_check.py): Tengyun's greedy tokens equal HF's on an fp32 twin holding the
exact dequantized weights; TP=2 over gloo gives the single process's tokens (row-parallel act
order: each rank holds every group's scales); a checkpoint that does not hold what its
config.json claims stops start-up with exit 2 naming the tensor or field."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from test_quantized_models import _hf_greedy, _prompts, _tengyun

sys.path.insert(0, str(Path(__file__).parent))
from awq_gptq_layouts import Format, write_checkpoint  # noqa: E402

BF16_STEPS, BF16_TP_LOGPROB_TOLERANCE = 4, 0.2
CASES = {  # name -> (tiny architecture, format)
    "awq_g32_llama": ("llama", Format("awq", group=32)),
    "awq_g64_qwen2": ("qwen2", Format("awq", group=64)),  # qkv bias
    "awq_g32_qwen3_moe": ("qwen3_moe", Format("awq", group=32)),  # quantised experts, dense router
    "gptq4_sym_v1_qwen2": ("qwen2", Format("gptq", bits=4, sym=True)),
    "gptq4_asym_act_order_v2_llama": ("llama", Format("gptq", bits=4, desc_act=True, checkpoint_format="gptq_v2")),
    "gptq8_asym_act_order_v1_qwen3": ("qwen3", Format("gptq", bits=8, desc_act=True)),
    "gptq4_act_order_v1_qwen3_moe": ("qwen3_moe", Format("gptq", bits=4, desc_act=True)),  # experts' g_idx
    "gptq8_sym_per_channel_v2_llama": ("llama", Format("gptq", bits=8, group=-1, sym=True,
                                                       checkpoint_format="gptq_v2")),
    # GPTQModel's dynamic: attention left dense, experts' down_proj 8-bit, the rest 4-bit (as its
    # MoE releases skip attention and shared experts)
    "gptq4_dynamic_qwen3_moe": ("qwen3_moe", Format("gptq", bits=4, dynamic=(
        (r"-:.*self_attn\.", {}), (r"+:.*experts\.\d+\.down_proj", {"bits": 8, "sym": True})))),
}


@pytest.fixture(scope="module")
def folders(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("awq_gptq")
    return {name: write_checkpoint(tiny_checkpoints[arch], out / name, out / f"{name}_twin", fmt)
            for name, (arch, fmt) in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_hf_on_the_dequantized_twin(folders, case):
    folder, twin = folders[case]
    assert [o.token_ids for o in _tengyun(folder)] == _hf_greedy(twin, _prompts())


@pytest.mark.parametrize("case", ["awq_g32_llama", "gptq4_asym_act_order_v2_llama"])
def test_tp2_over_gloo_gives_the_single_process_tokens(folders, case):
    """Column-parallel layers split along the outputs, row-parallel ones along the inputs in whole
    groups; act order's row-parallel ranks take their g_idx slice and every group's scales and zeros."""
    folder, _ = folders[case]
    single = [o.token_ids for o in _tengyun(folder)]
    assert [o.token_ids for o in _tengyun(folder, tensor_parallel_size=2)] == single


def _generate_cli(folder) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "generate", "Hello", str(folder),
                           "--max-tokens", "2", "--kv-cache-memory", "1MiB"], capture_output=True, text=True,
                          timeout=300)


def _broken_copy(folder, tmp_path, change=None, config_change=None):
    broken = shutil.copytree(folder, tmp_path / "broken")
    if change:
        tensors = load_file(broken / "model.safetensors")
        change(tensors)
        save_file(tensors, str(broken / "model.safetensors"))
    if config_change:
        config = json.loads((broken / "config.json").read_text())
        config_change(config["quantization_config"])
        (broken / "config.json").write_text(json.dumps(config))
    return broken


def _set(name, make):
    return lambda t: t.update({name: make(t[name])})


BROKEN = [  # (case, tensor change, config change, message)
    ("awq_g32_llama", _set("model.layers.0.mlp.down_proj.scales", lambda s: s[:2].contiguous()), None,
     r"model\.layers\.0\.mlp\.down_proj\.scales .* has shape \[2, 64\].*AWQ GEMM \(int4, group 32, zero point\) "
     r"expects \[4, 64\]"),
    ("awq_g32_llama", _set("model.layers.1.self_attn.o_proj.qweight", lambda q: q.float()), None,
     r"model\.layers\.1\.self_attn\.o_proj\.qweight .* is torch\.float32, but .* stores qweight as torch\.int32"),
    ("gptq4_sym_v1_qwen2", _set("model.layers.0.mlp.up_proj.qzeros", lambda z: z + 1), None,
     r"model\.layers\.0\.mlp\.up_proj\.qzeros .* holds zero points other than 8 \(gptq stores 7\), but "
     r"config\.json says sym true: set sym false"),
    ("gptq4_sym_v1_qwen2", _set("model.layers.1.self_attn.k_proj.g_idx", lambda g: g.flip(0).contiguous()), None,
     r"model\.layers\.1\.self_attn\.k_proj\.g_idx .* is not input // group_size, but config\.json says desc_act "
     r"false: set desc_act true"),
    ("gptq8_asym_act_order_v1_qwen3", _set("model.layers.0.self_attn.q_proj.qweight", lambda q: q[:8].contiguous()),
     None, r"model\.layers\.0\.self_attn\.q_proj\.qweight .* has shape \[8, 128\].*expects \[16, 128\]"),
    ("gptq4_asym_act_order_v2_llama", _set("model.layers.0.self_attn.k_proj.g_idx", lambda g: g.flip(0).contiguous()),
     None, r"self_attn\.[qk]_proj\.g_idx .* differs from the g_idx of another module fused into this layer"),
    ("gptq4_sym_v1_qwen2", None, lambda q: q.update(bits=3),
     r"quantization_config\.bits is 3; Tengyun's GPTQ reader supports 4, 8"),
    ("awq_g32_llama", None, lambda q: q.update(group_size=48),
     r"quantization_config\.group_size is 48; Tengyun's AWQ reader supports 32, 64, 128"),
    ("awq_g32_llama", None, lambda q: q.update(version="gemv"),
     r"quantization_config\.version is 'gemv'; Tengyun's AWQ reader supports 'gemm'"),
    ("gptq4_sym_v1_qwen2", None, lambda q: q.update(checkpoint_format="marlin"),
     r"quantization_config\.checkpoint_format is 'marlin'; Tengyun's GPTQ reader supports 'gptq', 'gptq_v2'"),
    ("gptq4_dynamic_qwen3_moe", None, lambda q: q["dynamic"][r"+:.*experts\.\d+\.down_proj"].update(bits=2),
     r"quantization_config\.dynamic\['\+:\.\*experts.*'\]\.bits is 2; Tengyun's GPTQ reader supports 4, 8"),
    ("gptq4_dynamic_qwen3_moe", None, lambda q: q["dynamic"].pop(r"-:.*self_attn\."),
     r"8 of them dense weights of layers config\.json's quantization_config quantises \(e\.g\. "
     r"model\.layers\.\d\.self_attn\.\w+\.weight .*dynamic as \"-:<regex>\" \(GPTQ\)"),
]


@pytest.mark.parametrize("case, change, config_change, message", BROKEN)
def test_a_checkpoint_not_holding_its_claimed_format_exits_2_naming_the_tensor_or_field(
        folders, tmp_path, case, change, config_change, message):
    proc = _generate_cli(_broken_copy(folders[case][0], tmp_path, change, config_change))
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr
    assert re.search(message, last), last


def test_quantization_flag_reads_autogptq_s_side_file(folders, tmp_path):
    """Older AutoGPTQ folders keep quantize_config.json beside a config.json without the section
    (vLLM reads it with --quantization gptq, as Tengyun does)."""
    folder = _broken_copy(folders["gptq4_sym_v1_qwen2"][0], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "quantize_config.json").write_text(json.dumps(config.pop("quantization_config")))
    (folder / "config.json").write_text(json.dumps(config))
    expected = [o.token_ids for o in _tengyun(folders["gptq4_sym_v1_qwen2"][0])]
    assert [o.token_ids for o in _tengyun(folder, quantization="gptq")] == expected



def test_tp2_bfloat16_runs_act_order_row_parallel_slices_through_the_int4_matmul(folders):
    """In bfloat16 every layer runs torch's int4 matmul, a row-parallel rank's act-order slice
    padded to every group (quant_kernels.in_group_order). bfloat16 sums in another order on two
    ranks (logprobs measured within 0.07 over all 30 tokens), so a late greedy tie may flip: the
    first BF16_STEPS tokens of each prompt are the single process's, their logprobs within
    BF16_TP_LOGPROB_TOLERANCE; a misread slice differs from the first token."""
    folder, _ = folders["gptq4_asym_act_order_v2_llama"]
    single = _tengyun(folder, dtype="bfloat16")
    for one, two in zip(single, _tengyun(folder, dtype="bfloat16", tensor_parallel_size=2)):
        assert two.token_ids[:BF16_STEPS] == one.token_ids[:BF16_STEPS]
        for step, token in enumerate(one.token_ids[:BF16_STEPS]):
            assert abs(one.logprobs[step][token].logprob - two.logprobs[step][token].logprob) < \
                BF16_TP_LOGPROB_TOLERANCE
