"""Qwen3.5 and Qwen3.5-MoE (hybrid Gated DeltaNet + gated attention) match HF transformers on tiny
random fp32 checkpoints: under chunked prefill and preemption, over a 64-token decode, and from
the multimodal checkpoint layout as from the text-only one. Also the hybrid cache's sizing."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from tengyun import LLM, SamplingParams
from tengyun.sizing.cache import KVCacheShape, split_budget, state_shape
from tengyun.model_spec import ModelSpec
from conftest import QWEN3_5_MOE, QWEN3_5_TEXT, make_tiny_qwen3_5
from test_hf_parity import TOP_K, _prompts

TEXT, MOE = QWEN3_5_TEXT, QWEN3_5_MOE
_hf_text_model = make_tiny_qwen3_5


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def arch_checkpoint(request, tmp_path_factory, tiny_tokenizer_dir):
    folder = tmp_path_factory.mktemp(f"tiny_{request.param}")
    _hf_text_model(request.param).save_pretrained(folder)
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return request.param, folder


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    folder = tmp_path_factory.mktemp("tiny_qwen3_5_text")
    _hf_text_model().save_pretrained(folder)
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="module")
def multimodal_checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    """The same text weights in Qwen3_5ForConditionalGeneration's layout, with a vision tower."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=TEXT, vision_config=vision))
    text = _hf_text_model()
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    folder = tmp_path_factory.mktemp("tiny_qwen3_5_mm")
    model.save_pretrained(folder)
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def _hf_reference(model, prompts, max_tokens):
    """Per prompt: greedy tokens and per-step top-5 (ids, logprobs), full recompute each step."""
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids, tokens, tops = list(prompt), [], []
            for _ in range(max_tokens):
                logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
                top = torch.topk(logprobs, TOP_K)
                tokens.append(int(logprobs.argmax()))
                tops.append((top.indices.tolist(), top.values.tolist()))
                ids.append(tokens[-1])
            results.append((tokens, tops))
    return results


def _assert_matches(outputs, reference):
    for output, (ref_tokens, ref_tops) in zip(outputs, reference):
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens
        for step, (ref_ids, ref_values) in enumerate(ref_tops):
            for token, value in zip(ref_ids, ref_values):
                assert completion.logprobs[step][token].logprob == pytest.approx(value, abs=1e-4)


def assert_batch_matches_under_preemption(hf_model, folder, **engine_args):
    """12 prompts, 12 greedy tokens each, under chunked prefill and forced preemption: HF's tokens
    and top-5 logprobs; afterwards no KV block or state slot is held. Returns the engine."""
    reference = _hf_reference(hf_model, _prompts(300), 12)
    llm = LLM(str(folder), dtype="float32", block_size=8, max_model_len=104,
              num_gpu_blocks_override=13,  # 104 slots for ~660 tokens of demand: preemption must happen
              max_num_batched_tokens=32, max_num_seqs=16, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=TOP_K)
    _assert_matches(llm.generate(_prompts(300), params), reference)
    engine = llm.llm_engine
    stats = engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache_usage == 0.0
    assert engine.scheduler.state_pool.num_free == engine.scheduler.state_pool.num_slots == 16
    return engine


def assert_64_token_decode_matches(hf_model, folder):
    prompt = _prompts(300)[1]
    reference = _hf_reference(hf_model, [prompt], 64)
    llm = LLM(str(folder), dtype="float32", block_size=8, max_model_len=128, kv_cache_memory="1MiB")
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=TOP_K)
    _assert_matches(llm.generate([prompt], params), reference)


def test_greedy_matches_hf_under_chunked_prefill_and_preemption(arch_checkpoint):
    arch, folder = arch_checkpoint
    engine = assert_batch_matches_under_preemption(_hf_text_model(arch), folder)
    assert engine.config.enable_prefix_caching  # on by default, as for dense models
    assert engine.get_stats().prefix_cache_hits > 0  # four prompts share 40 tokens


def test_single_sequence_decode_of_64_tokens_matches_hf(arch_checkpoint):
    arch, folder = arch_checkpoint
    assert_64_token_decode_matches(_hf_text_model(arch), folder)


def test_multimodal_layout_gives_the_text_only_tokens(text_checkpoint, multimodal_checkpoint, caplog):
    prompts = _prompts(300)[:6]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    text = LLM(str(text_checkpoint), dtype="float32", block_size=8, max_model_len=128, kv_cache_memory="1MiB",
               max_num_batched_tokens=32)
    expected = [o.outputs[0].token_ids for o in text.generate(prompts, params)]
    with caplog.at_level(logging.INFO, logger="tengyun.models.loader"):
        mm = LLM(str(multimodal_checkpoint), dtype="float32", block_size=8, max_model_len=128, kv_cache_memory="1MiB",
                 max_num_batched_tokens=32)
    assert caplog.text.count("model.visual.* checkpoint tensors: vision tower") == 1
    assert [o.outputs[0].token_ids for o in mm.generate(prompts, params)] == expected


# The full-attention sizes a ModelSpec needs besides the linear-attention ones under test.
_ATTENTION = dict(hidden_size=5120, num_attention_heads=24, num_key_value_heads=4, vocab_size=248_320)


def test_state_bytes_per_slot_of_qwen3_5_27b():
    cfg = dict(num_hidden_layers=64, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
               linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4, **_ATTENTION)
    shape = state_shape(ModelSpec.from_hf_config(cfg), dtype_bytes=2)
    assert (shape.num_layers, shape.conv_dim, shape.conv_width) == (48, 10240, 3)
    assert shape.bytes_per_slot == 48 * (10240 * 3 * 2 + 48 * 128 * 128 * 4)


def test_budget_gives_slots_first_then_blocks_and_fewer_slots_when_tight():
    kv = KVCacheShape(num_layers=1, num_kv_heads=1, head_dim=8, dtype_bytes=4)  # 64 bytes/token, 1 KiB/block
    # Roomy: max_num_seqs slots, the rest in blocks.
    assert split_budget(100 * 1024, 16, kv, 1000, max_num_seqs=4, max_model_len=64) == (96, 4, 0)
    # Tight: keep one max_model_len sequence of KV (4 blocks); 3 slots fit in the other 6 KiB.
    assert split_budget(10 * 1024, 16, kv, 2048, max_num_seqs=8, max_model_len=64) == (4, 3, 0)
    # Not a hybrid model: everything in blocks.
    assert split_budget(10 * 1024, 16, kv, 0, max_num_seqs=8, max_model_len=64) == (10, 0, 0)


def test_prefix_caching_snapshots_take_at_most_half_the_rest_and_one_per_slot():
    kv = KVCacheShape(num_layers=1, num_kv_heads=1, head_dim=8, dtype_bytes=4)  # 1 KiB/block
    # 4 slots (3.9 KiB) leave 96.1 KiB: 4 snapshots (one per slot), 92 blocks.
    assert split_budget(100 * 1024, 16, kv, 1000, max_num_seqs=4, max_model_len=64, prefix_caching=True) == (92, 4, 4)
    # 30 KiB: 8 slots of 2 KiB leave 14 KiB; half of it holds 3 snapshots, 8 blocks stay.
    assert split_budget(30 * 1024, 16, kv, 2048, max_num_seqs=8, max_model_len=64, prefix_caching=True) == (8, 8, 3)
    # 20 KiB: 8 slots leave 4 KiB, the one max_model_len sequence's KV: no snapshot (and the
    # slots are never cut for snapshots).
    assert split_budget(20 * 1024, 16, kv, 2048, max_num_seqs=8, max_model_len=64, prefix_caching=True) == (4, 8, 0)


def test_tp_that_does_not_divide_the_linear_heads_names_the_field(tmp_path, tiny_tokenizer_dir):
    from tengyun.config import EngineConfig

    make_tiny_qwen3_5("qwen3_5", linear_num_key_heads=1, linear_num_value_heads=3).save_pretrained(tmp_path)
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    with pytest.raises(ValueError, match="does not divide linear_num_key_heads 1"):
        EngineConfig(str(tmp_path), dtype="float32", tensor_parallel_size=2).finalize()


def test_state_shape_per_tp_rank_holds_its_share_of_the_heads():
    spec = ModelSpec.from_hf_config(dict(
        num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        **_ATTENTION))
    whole, quarter = state_shape(spec, 2), state_shape(spec, 2, tp_size=4)
    assert (quarter.conv_dim, quarter.num_v_heads) == (whole.conv_dim // 4, 12)
    assert quarter.bytes_per_slot * 4 == whole.bytes_per_slot
