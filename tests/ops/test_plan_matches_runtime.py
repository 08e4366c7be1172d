"""`tengyun plan` and the engine give one answer: the same dtype, KV bytes per token, recurrent
state per sequence and its slots and prefix-cache snapshots, weights per rank and KV blocks, for
every model family, with the engine's
real Worker (random-weight tiny checkpoints) on this CPU: with the CPU's --kv-cache-memory budget,
and with a simulated accelerator's (device memory x --gpu-memory-utilization - weights -
activation reserve)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import QWEN3_5_MOE, QWEN3_5_TEXT, randomize_norms_and_routers
from tengyun.config import EngineConfig
from tengyun.model_spec import ModelSpec
from tengyun.sizing.checkpoint import read_model, read_quantization
from tengyun.sizing.plan import Cards, Plan, make_plan
from tengyun.sizing.resolve import resolve_sizing
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.worker.worker import Worker

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"]
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def folders(tiny_checkpoints, tiny_hybrid_checkpoints, tmp_path_factory, tiny_tokenizer_dir) -> dict:
    return {**tiny_checkpoints, **tiny_hybrid_checkpoints,
            "qwen3_next": _qwen3_next_folder(tmp_path_factory.mktemp("plan_qwen3_next"), tiny_tokenizer_dir)}


def _qwen3_next_folder(folder, tokenizer_dir):
    """Qwen3-Next as released: no layer_types in config.json (every 2nd layer full attention here),
    layer 0 dense, the rest MoE with a shared expert."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(**QWEN3_5_TEXT, **QWEN3_5_MOE, mlp_only_layers=[0], full_attention_interval=2)
    randomize_norms_and_routers(transformers.Qwen3NextForCausalLM(config)).save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["layer_types"]  # as Qwen/Qwen3-Next-80B-A3B-Instruct's config.json
    cfg["full_attention_interval"] = 2
    (folder / "config.json").write_text(json.dumps(cfg))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def _plan_for(folder, device: str, cards: Cards | None = None, **flags) -> Plan:
    """The plan `tengyun plan FOLDER --device DEVICE` makes for the engine's ``flags`` (EngineConfig
    fields): resolved by the engine's own resolve, the checkpoint's quantisation read as it reads it."""
    hf_config, checkpoint_bytes, name = read_model(folder)
    sizing = resolve_sizing(EngineConfig(str(folder), **flags), ModelSpec.from_hf_config(hf_config), device,
                            Path(folder))
    return make_plan(hf_config, sizing, cards, checkpoint_bytes, name, read_quantization(folder, hf_config))


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_plan_matches_the_engine_on_cpu(folders, family, dtype):
    flags = dict(dtype=dtype, kv_cache_memory="2MiB", max_model_len=MAX_MODEL_LEN, max_num_seqs=4, block_size=16)
    config = EngineConfig(str(folders[family]), **flags).finalize()
    worker = Worker(config)
    plan = _plan_for(folders[family], config.device_type, **flags)
    [stage] = plan.stages
    assert (plan.dtype, plan.kv_cache_dtype) == (config.dtype, config.kv_cache_dtype)
    assert stage.kv_bytes_per_token == worker.kv_shape.bytes_per_token
    assert stage.state_bytes_per_seq == worker.state_shape.bytes_per_slot
    assert stage.weight_bytes == worker.weight_bytes
    assert (plan.blocks, stage.state_slots, stage.state_snapshots) == (
        worker.num_blocks, worker.num_state_slots, worker.num_state_snapshots)
    assert plan.weight_scale == 1.0 and plan.notes == []  # a float32 checkpoint served as bfloat16 is not "scaled"


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_plan_counts_hybrid_state_snapshots_only_with_prefix_caching(folders, family):
    """Prefix caching on (the default): every state slot has a snapshot row, paid from the same
    budget, so fewer KV blocks fit than with it off; the plan follows both ways."""
    counts = {}
    for caching in (True, False):
        flags = dict(kv_cache_memory="2MiB", max_model_len=MAX_MODEL_LEN, max_num_seqs=64, block_size=16,
                     enable_prefix_caching=caching)
        config = EngineConfig(str(folders[family]), **flags).finalize()
        worker = Worker(config)
        [stage] = _plan_for(folders[family], config.device_type, **flags).stages
        counts[caching] = (stage.blocks, stage.state_slots, stage.state_snapshots)
        assert counts[caching] == (worker.num_blocks, worker.num_state_slots, worker.num_state_snapshots)
    assert counts[True][2] == counts[True][1] > 0 and counts[False][2] == 0
    assert counts[True][0] < counts[False][0]  # the snapshot rows came out of the KV blocks


def _with_mtp_head(folder, out):
    """``folder`` plus an MTP head (mtp.* tensors; mtp_num_hidden_layers 1, or for Qwen3-Next
    nothing: the engine counts mtp.layers.N): the last full-attention layer's attention and norms,
    layer 0's MLP (the kind the head's layer has), fc and the head's norms."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    tensors = load_file(out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    last_full = max(int(n.split(".")[2]) for n in tensors if ".self_attn." in n)
    head = {n.replace(f"model.layers.{last_full}.", "mtp.layers.0."): t.clone() for n, t in tensors.items()
            if n.startswith(f"model.layers.{last_full}.") and ".mlp." not in n}
    head |= {n.replace("model.layers.0.", "mtp.layers.0."): t.clone() for n, t in tensors.items()
             if n.startswith("model.layers.0.mlp.")}
    hidden = cfg["hidden_size"]
    head |= {f"mtp.{n}.weight": torch.zeros(hidden) for n in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding")}
    head["mtp.fc.weight"] = torch.zeros(hidden, 2 * hidden)
    save_file(head, out / "mtp.safetensors")
    if cfg["architectures"][0] != "Qwen3NextForCausalLM":
        (out / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    return out


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_plan_with_mtp_matches_the_engine(folders, family, tmp_path):
    """--speculative-config method mtp: the head's weights and its KV layer, as the worker holds them."""
    folder = _with_mtp_head(folders[family], tmp_path / family)
    flags = dict(kv_cache_memory="2MiB", max_model_len=MAX_MODEL_LEN, max_num_seqs=4, block_size=16,
                 speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    config = EngineConfig(str(folder), **flags).finalize()
    worker = Worker(config)
    plan = _plan_for(folder, config.device_type, **flags)
    [stage] = plan.stages
    assert stage.params.mtp > 0 and stage.weight_bytes == worker.weight_bytes
    assert stage.kv_bytes_per_token == worker.kv_shape.bytes_per_token * (stage.attention_layers) // (
        stage.attention_layers - 1)
    assert (plan.blocks, stage.state_slots, stage.state_snapshots) == (
        worker.num_blocks, worker.num_state_slots, worker.num_state_snapshots)


class SimulatedAccelerator(CpuPlatform):
    """This CPU sizing its KV cache as an accelerator does: from memory_info() x
    --gpu-memory-utilization, with ``used`` bytes already taken (the weights) out of ``total``."""

    kv_cache_in_host_memory = False

    def __init__(self, total: int, used: int):
        self.total, self.used = total, used

    def memory_info(self) -> tuple[int, int]:
        return self.total - self.used, self.total


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_matches_the_engine_on_a_simulated_device_budget(folders, family, monkeypatch):
    settings = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=4, block_size=16, gpu_memory_utilization=0.5)
    config = EngineConfig(str(folders[family]), **settings).finalize()
    weights = Worker(config).weight_bytes
    device = SimulatedAccelerator(total=64 * 2**20, used=weights)
    monkeypatch.setattr("tengyun.worker.worker.get_platform", lambda requested: device)
    worker = Worker(config)
    # The plan given the engine's measured step (--activation-reserve) counts the engine's blocks.
    measured = worker.memory_report.activation_used
    plan = _plan_for(folders[family], config.device_type, Cards(memory=device.total, activation_reserve=measured),
                     **settings)
    [stage] = plan.stages
    assert stage.weight_bytes == worker.weight_bytes == weights
    assert stage.budget_bytes == int(device.total * 0.5) - weights - measured
    assert (plan.blocks, stage.state_slots, stage.state_snapshots) == (
        worker.num_blocks, worker.num_state_slots, worker.num_state_snapshots)


@pytest.fixture(scope="module")
def quantized_folders(folders, tmp_path_factory) -> dict:
    from tengyun.ops.quantize import quantize_folder

    out = tmp_path_factory.mktemp("plan_quantized")
    return {(family, scheme): quantize_folder(folders[family], out / f"{family}_{scheme}", scheme, 32).out_dir
            for family in ("llama", "qwen2", "qwen3_moe") for scheme in ("w8a8", "w4a16")}


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])  # bfloat16: torch's int4 CPU layout (scales + zeros)
@pytest.mark.parametrize("scheme", ["w8a8", "w4a16"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
def test_plan_counts_quantized_weights_as_the_engine_holds_them(quantized_folders, family, scheme, dtype):
    folder = quantized_folders[family, scheme]
    flags = dict(dtype=dtype, kv_cache_memory="2MiB", max_model_len=MAX_MODEL_LEN, max_num_seqs=4, block_size=16)
    config = EngineConfig(str(folder), **flags).finalize()
    worker = Worker(config)
    hf_config, _, _ = read_model(folder)
    quant = read_quantization(folder, hf_config)
    plan = _plan_for(folder, "cpu", **flags)
    [stage] = plan.stages
    assert quant is not None and plan.quantization == quant.describe()
    assert stage.weight_bytes == worker.weight_bytes
    assert plan.blocks == worker.num_blocks
    dense = make_plan(hf_config, resolve_sizing(EngineConfig(dtype=dtype, kv_cache_memory=2**21, block_size=16),
                                                ModelSpec.from_hf_config(hf_config), "cpu"))
    assert stage.weight_bytes < dense.stages[0].weight_bytes  # the quantised layers are smaller


def _stored_wider_than_served(source, out, config_dtype: str | None):
    """``source`` (float32 safetensors) with config.json saying ``config_dtype`` (None: no dtype, as
    SmolLM2's GGUF conversion writes it), to be served in bfloat16."""
    shutil.copytree(source, out)
    cfg = {k: v for k, v in json.loads((out / "config.json").read_text()).items() if k not in ("dtype", "torch_dtype")}
    (out / "config.json").write_text(json.dumps(cfg | ({"torch_dtype": config_dtype} if config_dtype else {})))
    return out


@pytest.mark.parametrize("case, config_dtype", [("llama", None), ("llama", "bfloat16"), ("qwen3_moe", None),
                                                 ("llama_w8a8", None)])
def test_plan_counts_weights_in_the_served_dtype_when_stored_wider(folders, quantized_folders, tmp_path, monkeypatch,
                                                                   case, config_dtype):
    """float32 on disk, served in bfloat16 (SmolLM2's folder on a CPU with avx512_bf16: `tengyun plan`
    counted 513.1 MiB, 'scaled by 2.000', where the runtime loads 256.6 MiB): weights, and the KV
    blocks a device budget leaves after them, as the engine holds them; dense, MoE and quantised."""
    source = quantized_folders["llama", "w8a8"] if case == "llama_w8a8" else folders[case]
    folder = _stored_wider_than_served(source, tmp_path / case, config_dtype)
    flags = dict(dtype="bfloat16", max_model_len=MAX_MODEL_LEN, max_num_seqs=4, block_size=16,
                 gpu_memory_utilization=0.5)
    config = EngineConfig(str(folder), **flags).finalize()
    weights = Worker(config).weight_bytes
    device = SimulatedAccelerator(total=64 * 2**20, used=weights)
    monkeypatch.setattr("tengyun.worker.worker.get_platform", lambda requested: device)
    worker = Worker(config)
    cards = Cards(memory=device.total, activation_reserve=worker.memory_report.activation_used)  # the measured step
    plan = _plan_for(folder, config.device_type, cards, **flags)
    [stage] = plan.stages
    assert plan.sizing == config.sizing  # one resolve
    assert plan.weight_scale == 1.0 and plan.notes == []
    assert stage.weight_bytes == worker.weight_bytes == weights
    assert (plan.blocks, stage.state_slots, stage.state_snapshots) == (
        worker.num_blocks, worker.num_state_slots, worker.num_state_snapshots)
