"""`tengyun plan`: figures checked by hand for Qwen3-0.6B and Qwen3.5-397B-A17B, parameter counts
against real checkpoints, and plan vs. the engine's own KV allocation on this machine."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from tengyun.config import EngineConfig
from tengyun.model_spec import as_spec
from tengyun.ops.plan import smallest_fit
from tengyun.sizing.checkpoint import read_model
from tengyun.sizing.model_size import total_params
from tengyun.sizing.plan import Cards, make_plan
from tengyun.sizing.resolve import ResolvedSizing, resolve_sizing

FIXTURES = Path(__file__).parents[1] / "fixtures" / "ops"
GiB = 2**30
BUDGET_64G = int(64 * GiB * 0.9)  # 61,847,529,062 B per card at --gpu-memory-utilization 0.9


def load(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def sizing(cfg: dict, device: str = "npu", **flags) -> ResolvedSizing:
    """EngineConfig ``flags`` resolved for ``cfg`` on ``device`` as `tengyun plan` resolves them
    (the device's block size unless --block-size is among them: 128 tokens on npu, the smallest
    torch_npu's paged attention takes, docs/ascend.md)."""
    return resolve_sizing(EngineConfig(**flags), as_spec(cfg), device)


def test_qwen3_0_6b_on_one_64g_card_by_hand():
    plan = make_plan(load("qwen3_0_6b"), sizing(load("qwen3_0_6b")))
    [stage] = plan.stages
    # embedding 151936 x 1024 (tied: no separate LM head); per layer q 1024x2048, k and v 1024x1024 each,
    # o 2048x1024, q/k norm 128 each, MLP 3 x 1024 x 3072, two norms of 1024; final norm 1024.
    per_layer = 1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 2 * 128 + 3 * 1024 * 3072 + 2 * 1024
    params = 151_936 * 1024 + 28 * per_layer + 1024
    assert params == 596_049_920 == plan.total_params == stage.params.total
    assert stage.weight_bytes == 2 * params  # bfloat16
    activation = 2048 * (4 * 1024 + 2 * 3072) * 2 + 256 * 151_936 * 4  # tokens x (4 hidden + gate_up) + logits
    assert plan.activation_bytes == activation == 197_525_504
    assert stage.budget_bytes == BUDGET_64G - 2 * params - activation == 60_457_903_718
    assert stage.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2 == 114_688
    assert plan.blocks == stage.budget_bytes // (128 * 114_688) == 4_118
    assert plan.cache_tokens == 527_104
    assert plan.max_model_len == 40_960  # max_position_embeddings
    assert plan.max_concurrency == 4_118 // (40_960 // 128) == 12
    assert plan.fits
    assert smallest_fit(load("qwen3_0_6b"), sizing(load("qwen3_0_6b"))) == (1, 1)


def test_qwen3_0_6b_context_that_does_not_fit_names_the_limit():
    plan = make_plan(load("qwen3_0_6b"), sizing(load("qwen3_0_6b"), max_model_len=40_960), Cards(memory=2 * GiB))
    # 2 GiB x 0.9 - 1,192,099,840 - 197,525,504 = 543,109,939 B -> 36 blocks = 4,608 tokens < 40,960
    assert plan.stages[0].budget_bytes == int(2 * GiB * 0.9) - 1_192_099_840 - 197_525_504 == 543_109_939
    assert plan.cache_tokens == 543_109_939 // (128 * 114_688) * 128 == 4_608
    assert not plan.fits and plan.max_concurrency == 0


def test_qwen3_5_397b_a17b_tp8_pp4_on_64g_cards_by_hand():
    cfg = load("qwen3_5_397b_a17b")
    plan = make_plan(cfg, sizing(cfg, tensor_parallel_size=8, pipeline_parallel_size=4, max_model_len=32_768,
                                  enable_prefix_caching=False))
    # 60 layers, 15 per stage; full attention at layers 3, 7, ..., 59: 3 on stage 0, 4 on stages 1-3.
    assert [s.layers for s in plan.stages] == [(0, 15), (15, 30), (30, 45), (45, 60)]
    assert [s.attention_layers for s in plan.stages] == [3, 4, 4, 4]
    h, tp = 4096, 8
    attention = h * 32 * 256 * 2 // tp + 2 * h * 1 * 256 + 32 * 256 * h // tp + 2 * 256  # gated q, 1 KV head/rank
    linear = (h * (2 * 2048 + 2 * 8192) // tp + h * 2 * 64 // tp + (2 * 2048 + 8192) * 4 // tp + 2 * 64 // tp
              + 128 + 8192 * h // tp)
    moe = 512 * 3 * h * 1024 // tp + 512 * h + 3 * h * 1024 // tp + h  # experts, router, shared expert + gate
    vocab = 248_320 // tp * h  # embedding / LM head, vocab-parallel
    assert (attention, linear, moe, vocab) == (14_680_576, 14_751_888, 808_980_480, 127_139_840)
    stage0 = vocab + 3 * attention + 12 * linear + 15 * moe + 15 * 2 * h
    stage3 = 4 * attention + 11 * linear + 15 * moe + 15 * 2 * h + h + vocab
    assert [s.params.total for s in plan.stages] == [stage0, stage3 - h - vocab, stage3 - h - vocab, stage3]
    assert (stage0, stage3) == (12_483_034_304, 12_482_967_088)
    assert plan.total_params == 396_346_350_336  # decoder only: no vision tower, no MTP layer
    activation = 2048 * (4 * h + (10 * 2 * 1024 + 2 * 1024) // tp) * 2 + 256 * 248_320 * 4
    assert plan.activation_bytes == activation == 332_922_880
    budget3 = BUDGET_64G - 2 * stage3 - activation
    assert plan.stages[3].budget_bytes == budget3 == 36_548_672_006
    # KV: 2 x 4 layers x 1 head x 256 x 2 B; state per sequence: 11 layers x (conv 12288/8 x 3 x 2 B
    # + SSM 64/8 heads x 128 x 128 x 4 B); 256 slots first, KV blocks from the rest.
    assert plan.stages[3].kv_bytes_per_token == 2 * 4 * 1 * 256 * 2 == 4096
    state = 11 * (12288 // tp * 3 * 2 + 64 // tp * 128 * 128 * 4)
    assert plan.stages[3].state_bytes_per_seq == state == 5_868_544
    assert plan.stages[3].blocks == (budget3 - 256 * state) // (128 * 4096) == 66_845
    state0 = 12 * (12288 // tp * 3 * 2 + 64 // tp * 128 * 128 * 4)
    assert plan.stages[0].kv_bytes_per_token == 3072
    assert plan.stages[0].blocks == (BUDGET_64G - 2 * stage0 - activation - 256 * state0) // (128 * 3072) == 88_779
    assert plan.blocks == 66_845 and plan.cache_tokens == 8_556_160
    assert plan.max_concurrency == 256 and plan.fits
    # Prefix caching (the default) keeps a snapshot row per slot: 512 sequences' state come first.
    cached = make_plan(cfg, sizing(cfg, tensor_parallel_size=8, pipeline_parallel_size=4, max_model_len=32_768))
    assert (cached.stages[3].state_slots, cached.stages[3].state_snapshots) == (256, 256)
    assert cached.blocks == (budget3 - 512 * state) // (128 * 4096) == 63_980
    assert cached.max_concurrency == 63_980 // (32_768 // 128) == 249
    # The whole decoder in bf16 is 792.7 GB: 14 cards of 61.8 GB usable is the fewest that also hold KV.
    assert smallest_fit(cfg, sizing(cfg, max_model_len=32_768)) == (2, 7)


def test_qwen3_5_397b_a17b_with_mtp_counts_the_heads_weights_and_kv_on_the_last_stage():
    """--speculative-config method mtp: stage 3 also holds the MTP head (fc, three norms, one
    full-attention MoE layer, and its own embedding copy: stage 3 has none) and its KV layer."""
    cfg = load("qwen3_5_397b_a17b")
    request = sizing(cfg, tensor_parallel_size=8, pipeline_parallel_size=4, max_model_len=32_768,
                     enable_prefix_caching=False)
    plain, mtp = make_plan(cfg, request), make_plan(cfg, dataclasses.replace(request, mtp_layers=1))
    h, attention, moe, vocab = 4096, 14_680_576, 808_980_480, 127_139_840  # per rank, as above
    head = 2 * h * h + 3 * h + (attention + moe + 2 * h) + vocab
    assert [s.params.mtp for s in mtp.stages] == [0, 0, 0, head] and head == 984_375_808
    assert mtp.stages[3].weight_bytes == plain.stages[3].weight_bytes + 2 * head
    assert [s.attention_layers for s in mtp.stages] == [3, 4, 4, 5]
    assert mtp.stages[3].kv_bytes_per_token == 2 * 5 * 1 * 256 * 2
    state = 11 * (12288 // 8 * 3 * 2 + 64 // 8 * 128 * 128 * 4)
    assert mtp.blocks == (plain.stages[3].budget_bytes - 2 * head - 256 * state) // (128 * 5120) == 50_472
    # One stage: the embedding is shared, not copied.
    [one] = make_plan(cfg, sizing(cfg, tensor_parallel_size=8, max_model_len=32_768, kv_cache_memory=GiB,
                                  speculative_config={"method": "mtp", "num_speculative_tokens": 1}),
                      Cards(memory=None)).stages
    assert one.params.mtp == head - vocab


def test_qwen3_5_397b_a17b_fp8_is_planned_as_served_dequantized_in_bf16_on_910b():
    """Qwen/Qwen3.5-397B-A17B-FP8's quantization_config on the wrapper: the 910B has no FP8 matmul,
    so the engine dequantizes and the weights per card are the bf16 checkpoint's."""
    cfg = load("qwen3_5_397b_a17b")
    fp8 = dict(cfg, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]})
    request = sizing(cfg, tensor_parallel_size=8, pipeline_parallel_size=4, max_model_len=32_768)
    plan, bf16 = make_plan(fp8, request), make_plan(cfg, request)
    assert [s.weight_bytes for s in plan.stages] == [s.weight_bytes for s in bf16.stages]
    assert plan.blocks == bf16.blocks == 63_980  # prefix caching on (the default): snapshot rows as above
    assert plan.notes == ["FP8 block-quantized checkpoint (weight_block_size [128, 128]): npu has no FP8 matmul, so "
                          "the engine dequantizes it at load and its weights count in bfloat16: 738.25 GiB."]
    assert 396_346_350_336 * 2 / 2**30 == pytest.approx(738.25, abs=0.005)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_parameter_count_matches_the_checkpoint(tiny_checkpoints, arch):
    folder = tiny_checkpoints[arch]
    numel = 0
    for shard in folder.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            numel += sum(f.get_slice(k).get_shape().numel() if hasattr(f.get_slice(k).get_shape(), "numel")
                         else _prod(f.get_slice(k).get_shape()) for k in f.keys())
    cfg, checkpoint_bytes, _ = read_model(folder)
    assert total_params(cfg) == numel
    assert checkpoint_bytes == 4 * numel  # fp32 safetensors, read from the headers


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_plan_and_engine_agree_on_kv_blocks(tiny_checkpoints):
    """The same budget through `tengyun plan` and through the engine's allocator (CPU: the
    --kv-cache-memory budget) gives the same blocks and bytes."""
    from tengyun import LLM

    folder = tiny_checkpoints["qwen3"]
    budget = 1_000_000
    plan = make_plan(cfg := read_model(folder)[0], sizing(cfg, "cpu", kv_cache_memory=budget, dtype="float32",
                                                               max_model_len=256))
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=budget)
    engine_blocks = llm.llm_engine.scheduler.block_manager.num_blocks
    # 2 layers x 2 KV heads x 32 head dim x 2 (K, V) x 4 B = 1024 B per token; 16-token blocks.
    assert plan.stages[0].kv_bytes_per_token == 1024
    assert plan.blocks == engine_blocks == budget // (16 * 1024) == 61
    kv_cache = llm.llm_engine.executor.kv_cache
    # Plus the decode graphs' padding block, which no sequence gets (worker/decode_graphs.py).
    pad = int(llm.llm_engine.executor.runner.decode_graphs is not None)
    assert kv_cache.numel() * kv_cache.element_size() == (plan.blocks + pad) * 16 * plan.stages[0].kv_bytes_per_token


def test_plan_command_prints_the_arithmetic_and_json():
    def tengyun(*args):
        return subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "plan", *args],
                              capture_output=True, text=True, timeout=120)

    config = str(FIXTURES / "qwen3_0_6b" / "config.json")
    proc = tengyun(config)  # npu: 128-token blocks
    assert proc.returncode == 0, proc.stderr
    assert ("KV bytes per token per card: 2 (K, V) x 28 attention layers x 8 KV heads x 128 head dim x 2 B "
            "= 114,688 B") in proc.stdout
    assert "Max concurrent sequences at 40,960 tokens: min(--max-num-seqs 256, 4,118 // 320 blocks) = 12" \
        in proc.stdout
    report = json.loads(tengyun(config, "-tp", "2", "--json").stdout)
    assert (report["tensor_parallel_size"], report["fits"], report["smallest_fit"]) == (2, True, [1, 1])
    too_long = tengyun(config, "--device-memory", "2GiB")
    assert too_long.returncode == 1
    assert "--max-model-len 40,960 does NOT fit: the cache holds 4,608 tokens; lower --max-model-len to 4,608" \
        in too_long.stdout
    missing = tengyun(str(FIXTURES / "nowhere"))
    assert missing.returncode == 2
    assert missing.stderr.strip().endswith("nowhere not found: MODEL must be a Hugging Face folder with config.json, "
                                           "or a config.json file.")


def test_plan_command_counts_hybrid_state_snapshots_unless_prefix_caching_is_off():
    def stage3(*args):
        proc = subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "plan",
                               str(FIXTURES / "qwen3_5_397b_a17b"), "-tp", "8", "-pp", "4", "--max-model-len",
                               "32768", "--json", *args], capture_output=True, text=True, timeout=120)
        stage = json.loads(proc.stdout)["stages"][3]
        return stage["state_slots"], stage["state_snapshots"], stage["blocks"]

    assert stage3() == (256, 256, 63_980)  # 128-token blocks on npu
    assert stage3("--no-enable-prefix-caching") == (256, 0, 66_845)


def test_plan_command_counts_the_mtp_head_with_speculative_config_mtp():
    def plan(model, *args):
        return subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "plan", str(FIXTURES / model),
                               "--max-model-len", "32768", *args], capture_output=True, text=True, timeout=120)

    mtp = '{"method": "mtp", "num_speculative_tokens": 2}'
    proc = plan("qwen3_5_397b_a17b", "-tp", "8", "-pp", "4", "--json", "--speculative-config", mtp)
    stages = json.loads(proc.stdout)["stages"]
    assert [s["params"]["mtp"] for s in stages] == [0, 0, 0, 984_375_808]
    assert stages[3]["attention_layers"] == 5
    text = plan("qwen3_5_397b_a17b", "-tp", "8", "-pp", "4", "--speculative-config", mtp).stdout
    assert "+ MTP head 984,375,808" in text and "5 attention layers (1 of the MTP head)" in text
    ngram = plan("qwen3_5_397b_a17b", "-tp", "8", "-pp", "4", "--json", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 2}')
    assert json.loads(ngram.stdout)["stages"][3]["params"]["mtp"] == 0
    refused = plan("qwen3_0_6b", "--speculative-config", mtp)
    assert refused.returncode == 2
    assert "--speculative-config method mtp needs the model's multi-token-prediction layers" in refused.stderr


def test_plan_command_defaults_are_the_engines_on_the_planned_device():
    """--block-size and --dtype auto as `tengyun serve` resolves them on --device (npu by default:
    128-token blocks, the checkpoint's bfloat16; cpu: 16-token blocks, bf16 where native), and the
    engine's flags with the engine's checks."""
    def report(*args):
        proc = subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "plan",
                               str(FIXTURES / "qwen3_0_6b"), "--json", *args],
                              capture_output=True, text=True, timeout=120)
        return json.loads(proc.stdout) if proc.stdout else proc

    from tengyun.platforms.cpu.platform import native_bf16

    npu, cpu = report(), report("--device", "cpu", "--kv-cache-memory", "4GiB")
    assert (npu["device"], npu["block_size"], npu["dtype"]) == ("npu", 128, "bfloat16")
    # The fixture's checkpoint is bf16: bf16 on CPU where this host multiplies it natively.
    assert (cpu["device"], cpu["block_size"], cpu["dtype"]) == ("cpu", 16, "bfloat16" if native_bf16() else "float32")
    assert report("--kv-cache-memory", "4GiB")["device"] == "cpu"
    assert report("--dtype", "bf16", "--device", "cpu")["dtype"] == "bfloat16"
    bad = report("--block-size", "12")
    assert bad.returncode == 2 and "--block-size must be a power of two" in bad.stderr


def test_checkpoint_index_size_scales_weights_when_it_differs(tmp_path):
    """An int4 checkpoint's index says 0.3x what config.json's bf16 decoder would be: weights follow
    the index, and the report says why."""
    cfg = load("qwen3_0_6b")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 357_614_952}, "weight_map": {}}))
    hf_config, checkpoint_bytes, name = read_model(tmp_path)
    assert checkpoint_bytes == 357_614_952
    plan = make_plan(hf_config, sizing(hf_config), Cards(), checkpoint_bytes, name)
    assert plan.weight_scale == 357_614_952 / (596_049_920 * 2)
    assert plan.stages[0].weight_bytes == int(596_049_920 * 2 * plan.weight_scale) == 357_614_952
    assert plan.notes[0].startswith("The checkpoint holds 0.33 GiB but config.json's decoder is 1.11 GiB")
    # within 2 %: counted, not scaled
    same = make_plan(hf_config, sizing(hf_config), Cards(), 596_049_920 * 2 + 1000, name)
    assert same.weight_scale == 1.0 and same.notes == []


def test_tp_candidates_split_linear_heads_and_experts_evenly():
    from tengyun.ops.plan import tp_candidates

    dense = dict(num_attention_heads=32, num_key_value_heads=8, hidden_size=4096, num_hidden_layers=4, vocab_size=1000)
    assert tp_candidates(dense, 16) == [1, 2, 4, 8, 16]
    hybrid = dict(dense, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
                  linear_value_head_dim=128, num_experts=64, moe_intermediate_size=512)
    assert tp_candidates(hybrid, 16) == [1, 2, 4]  # 8 would split 4 key heads unevenly


def test_w4a16_qwen3_5_397b_a17b_counts_packed_weights_and_needs_fewer_cards():
    """compressed-tensors W4A16, group 128, routers kept in bf16: every other linear weight of a
    rank costs out x in x (1/2 B packed + 2 B / 128 scale) instead of 2 B, i.e. 95/64 B less per
    weight; the rest (embeddings, norms, conv, routers) is unchanged."""
    from tengyun.quantization import compressed_tensors
    from tengyun.quantization.config import detect_quantization

    cfg = load("qwen3_5_397b_a17b")
    cfg["quantization_config"] = compressed_tensors.quantization_config("w4a16", 128, ("lm_head", "re:.*mlp.gate$"))
    quant = detect_quantization(cfg)
    request = sizing(cfg, tensor_parallel_size=8, pipeline_parallel_size=4, max_model_len=32_768)
    dense, packed = make_plan(cfg, request), make_plan(cfg, request, quant=quant)
    h, tp = 4096, 8
    attention = h * 32 * 256 * 2 // tp + 2 * h * 1 * 256 + 32 * 256 * h // tp  # q (gated), k, v, o
    linear = h * (2 * 2048 + 8192) // tp + h * 8192 // tp + 2 * h * 64 // tp + 8192 * h // tp  # qkv, z, b, a, out
    moe = 512 * 3 * h * 1024 // tp + 3 * h * 1024 // tp + h  # experts, shared expert and its gate (not the router)
    quantized = 4 * attention + 11 * linear + 15 * moe  # stage 3: layers 45-59, 4 of them full attention
    assert quantized * 95 % 64 == 0
    assert dense.stages[3].weight_bytes - packed.stages[3].weight_bytes == quantized * 95 // 64
    assert packed.quantization == "compressed-tensors W4A16 (int4, group 128, symmetric)"
    assert smallest_fit(cfg, sizing(cfg, max_model_len=32_768), quant=quant) == (4, 1)  # 14 cards in bf16
