"""The NPU attention backend (tengyun/platforms/npu/kernels/attention.py) against the strict
stand-in (fake_torch_npu.py): the cache write through npu_scatter_pa_kv_cache (cache_mode "Norm")
where torch_npu has it, ATB's _npu_reshape_and_cache otherwise, and a clear error naming NNAL's
set_env.sh when that fails to load. The op-level tests call the ops as a mistaken caller would
(float32, block size 8 or 16 for a multi-token query, the mask inverted, an undocumented keyword,
the default NZ cache mode) and show the stand-in refuses each."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from tengyun import LLM, SamplingParams
from tengyun.platforms.cpu.platform import CpuPlatform

sys.path.insert(0, str(Path(__file__).parent))
import fake_torch_npu  # noqa: E402

PROMPTS = [[5, 6, 7], list(range(1, 40))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
ARGS = dict(dtype="bfloat16", block_size=128, max_model_len=128, kv_cache_memory="1MiB", max_num_batched_tokens=24)


def _tokens(folder):
    return [o.outputs[0].token_ids for o in LLM(folder, **ARGS).generate(PROMPTS, PARAMS)]


@pytest.fixture
def qwen3(tiny_checkpoints):
    return str(tiny_checkpoints["qwen3"])


def _npu_attention(monkeypatch, fake):
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(CpuPlatform, "attention_backend", lambda self, *args: "npu")


def test_cache_write_uses_npu_scatter_pa_kv_cache_where_torch_npu_has_it(qwen3, monkeypatch):
    reference = _tokens(qwen3)
    fake = fake_torch_npu.module(nnal=False)  # the ATB library would not even load
    _npu_attention(monkeypatch, fake)
    assert _tokens(qwen3) == reference
    assert fake.calls["npu_scatter_pa_kv_cache"] > 0 and fake.calls["_npu_reshape_and_cache"] == 0


def test_cache_write_falls_back_to_the_atb_op(qwen3, monkeypatch):
    reference = _tokens(qwen3)
    fake = fake_torch_npu.module(scatter_pa_kv_cache=False)
    _npu_attention(monkeypatch, fake)
    assert _tokens(qwen3) == reference
    assert fake.calls["_npu_reshape_and_cache"] > 0


def test_310p_keeps_the_atb_cache_write(qwen3, monkeypatch):
    """npu_scatter_pa_kv_cache is documented for Atlas A2 / A3 only."""
    reference = _tokens(qwen3)
    fake = fake_torch_npu.module()
    _npu_attention(monkeypatch, fake)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(get_device_name=lambda *a: "Ascend310P3"), raising=False)
    assert _tokens(qwen3) == reference
    assert fake.calls["_npu_reshape_and_cache"] > 0 and fake.calls["npu_scatter_pa_kv_cache"] == 0


def test_atb_op_without_nnal_names_its_set_env(qwen3, monkeypatch):
    _npu_attention(monkeypatch, fake_torch_npu.module(nnal=False, scatter_pa_kv_cache=False))
    with pytest.raises(RuntimeError, match="Install the NNAL package.*`source /usr/local/Ascend/nnal/atb/set_env.sh`"):
        _tokens(qwen3)


def _paged(dtype=torch.bfloat16, block_size=128, seq=4, heads=2, head_dim=64):
    query = torch.randn(1, seq, heads * head_dim, dtype=dtype)
    cache = torch.randn(2, block_size, heads * head_dim, dtype=dtype)
    return query, cache, dict(block_table=torch.tensor([[0, 1]], dtype=torch.int32), actual_seq_lengths_kv=[seq + 3],
                              num_heads=heads, num_key_value_heads=heads, scale=head_dim ** -0.5,
                              input_layout="BSH", block_size=block_size)


def _causal(query, mask=None):
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1) if mask is None else mask
    return dict(atten_mask=mask, sparse_mode=3, actual_seq_lengths=[query.shape[1]])


def test_attention_runs_as_documented():
    query, cache, kwargs = _paged()
    out, _ = fake_torch_npu.npu_fused_infer_attention_score(query, cache, cache, **kwargs, **_causal(query))
    assert out.shape == query.shape and out.dtype == torch.bfloat16
    query, cache, kwargs = _paged(block_size=16, seq=1)  # decode: 16-aligned blocks are enough
    fake_torch_npu.npu_fused_infer_attention_score(query, cache, cache, **kwargs)


def test_stand_in_refuses_float32_attention_and_cache_writes():
    query, cache, kwargs = _paged(dtype=torch.float32)
    with pytest.raises(RuntimeError, match="float16 / bfloat16"):
        fake_torch_npu.npu_fused_infer_attention_score(query, cache, cache, **kwargs, **_causal(query))
    key, k_cache = torch.randn(3, 2, 64), torch.zeros(2, 128, 2, 64)
    with pytest.raises(RuntimeError, match="float16 / bfloat16"):
        fake_torch_npu._npu_reshape_and_cache(key=key, value=key, key_cache=k_cache, value_cache=k_cache.clone(),
                                              slot_indices=torch.tensor([0, 1, 2], dtype=torch.int32))


@pytest.mark.parametrize("block_size", [8, 16, 192, 640])
def test_stand_in_refuses_blocks_a_multi_token_query_cannot_page(block_size):
    query, cache, kwargs = _paged(block_size=block_size)
    with pytest.raises(RuntimeError, match="128-512 in multiples of 128"):
        fake_torch_npu.npu_fused_infer_attention_score(query, cache, cache, **kwargs, **_causal(query))


def test_stand_in_refuses_decode_blocks_off_16():
    query, cache, kwargs = _paged(block_size=8, seq=1)
    with pytest.raises(RuntimeError, match="multiple of 16 up to 512"):
        fake_torch_npu.npu_fused_infer_attention_score(query, cache, cache, **kwargs)


def test_stand_in_refuses_an_inverted_causal_mask():
    query, cache, kwargs = _paged()
    kept = torch.tril(torch.ones(2048, 2048, dtype=torch.bool))  # True where attended: the wrong polarity
    with pytest.raises(RuntimeError, match="marks the masked"):
        fake_torch_npu.npu_fused_infer_attention_score(query, cache, cache, **kwargs, **_causal(query, kept))


def test_stand_in_takes_only_documented_keywords():
    query, cache, kwargs = _paged()
    with pytest.raises(TypeError):
        fake_torch_npu.npu_fused_infer_attention_score(query, cache, cache, **kwargs, **_causal(query), causal=True)
    with pytest.raises(TypeError):
        fake_torch_npu.npu_quant_matmul(torch.zeros(1, 8, dtype=torch.int8), torch.zeros(8, 8, dtype=torch.int8),
                                        torch.ones(8), out_dtype=torch.bfloat16)


def test_stand_in_refuses_the_default_nz_cache_mode_on_nd_caches():
    key, k_cache = torch.randn(3, 2, 64).bfloat16(), torch.zeros(2, 128, 2, 64).bfloat16()
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="need 'Norm'"):
        fake_torch_npu.npu_scatter_pa_kv_cache(key, key, k_cache, k_cache.clone(), slots)
    fake_torch_npu.npu_scatter_pa_kv_cache(key, key, k_cache, k_cache.clone(), slots, cache_mode="Norm")
    assert torch.equal(k_cache.view(-1, 2, 64)[:3], key)
