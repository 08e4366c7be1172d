"""The flash-attn backend without a GPU: its calls checked against a CPU reference of flash-attn
2's documented semantics (tests/layers/fake_flash_attn.py), and the CUDA platform's choice
between flash_attn and torch_sdpa (flash-attn importable or not, block size, KV dtype)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from tengyun import LLM, SamplingParams
from tengyun.config import EngineConfig
from tengyun.platforms.attention_backends import get_attention_backend
from tengyun.layers.attention.layer import Attention
from tengyun.layers.attention.metadata import AttentionMetadata, PrefillChunk
from tengyun.layers.attention.torch_sdpa import TorchSDPABackend
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.platforms.cuda.platform import CudaPlatform

sys.path.insert(0, str(Path(__file__).parent))
import fake_flash_attn  # noqa: E402

BLOCK = 256  # the smallest paged block size flash-attn 2 takes
HQ, HKV, D = 4, 2, 16


def _step(block_tables: dict[str, list[int]]) -> tuple[AttentionMetadata, torch.Tensor]:
    """One step's metadata: decodes of 300, 513 and 5 tokens (the new token included), a fresh
    prompt of 7 tokens, a 30-token chunk after 260 cached tokens, a fresh prompt of 20 tokens;
    and the flat positions of its 3 + 7 + 30 + 20 query tokens in the cache (slots)."""
    decode_lens, table = [300, 513, 5], lambda name: torch.tensor(block_tables[name])

    def slots(name, start, count):
        pos = torch.arange(start, start + count)
        return table(name)[pos // BLOCK] * BLOCK + pos % BLOCK

    slot_mapping = torch.cat([slots(f"d{i}", n - 1, 1) for i, n in enumerate(decode_lens)]
                             + [slots("p0", 0, 7), slots("p1", 260, 30), slots("p2", 0, 20)])
    width = max(len(block_tables[f"d{i}"]) for i in range(3))
    decode_tables = torch.tensor([block_tables[f"d{i}"] + [0] * (width - len(block_tables[f"d{i}"])) for i in range(3)])
    meta = AttentionMetadata(
        slot_mapping=slot_mapping, num_decode_tokens=3, decode_block_tables=decode_tables,
        decode_seq_lens=torch.tensor(decode_lens),
        prefills=[PrefillChunk(3, 7, 0, table("p0")), PrefillChunk(10, 30, 260, table("p1")),
                  PrefillChunk(40, 20, 0, table("p2"))])
    return meta, slot_mapping


def test_flash_attn_backend_matches_torch_sdpa_on_a_paged_cache(monkeypatch):
    fake = fake_flash_attn.module()
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    # Blocks out of order, so a table read in the wrong order shows.
    tables = {"d0": [7, 2], "d1": [4, 9, 1], "d2": [3], "p0": [5], "p1": [0, 8], "p2": [6]}
    meta, slots = _step(tables)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 10, BLOCK, HKV, D, generator=gen).to(torch.bfloat16)  # earlier tokens, both sequences
    q = torch.randn(60, HQ, D, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(60, HKV, D, generator=gen).to(torch.bfloat16) for _ in range(2))

    flash = get_attention_backend("flash_attn")
    k_cache, v_cache = cache.clone()
    flash.write_kv(k, v, k_cache, v_cache, meta)
    out = flash.forward(q, k, v, k_cache, v_cache, meta, scale=0.3)
    assert fake.calls == {"flash_attn_with_kvcache": 2, "flash_attn_varlen_func": 1}  # decodes, later chunk; fresh

    torch_sdpa = TorchSDPABackend()  # in float32 from the same bfloat16 values
    k_ref, v_ref = cache.float().clone()
    meta_ref, _ = _step(tables)
    torch_sdpa.write_kv(k.float(), v.float(), k_ref, v_ref, meta_ref)
    expected = torch_sdpa.forward(q.float(), k.float(), v.float(), k_ref, v_ref, meta_ref, scale=0.3)
    assert torch.equal(k_cache.float(), k_ref) and torch.equal(v_cache.float(), v_ref)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)  # bfloat16 output rounding


def _tiny_long_checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    from conftest import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_long"), tiny_tokenizer_dir, "qwen3",
                                max_position_embeddings=1024)


def test_engine_gives_torch_sdpas_greedy_tokens_on_flash_attn(tmp_path_factory, tiny_tokenizer_dir, monkeypatch):
    """Prompts over several 256-token blocks, prefilled in chunks across steps, with decodes
    and prefills in the same steps."""
    folder = str(_tiny_long_checkpoint(tmp_path_factory, tiny_tokenizer_dir))
    prompts = [[5, 6, 7], [(3 * i) % 300 + 1 for i in range(600)], list(range(1, 280))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    args = dict(dtype="bfloat16", block_size=BLOCK, max_model_len=1024, kv_cache_memory="4MiB",
                max_num_batched_tokens=160)
    reference = [o.outputs[0].token_ids for o in LLM(folder, **args).generate(prompts, params)]

    fake = fake_flash_attn.module()
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setattr(CpuPlatform, "attention_backend", lambda self, *args: "flash_attn")
    llm = LLM(folder, **args)
    layers = [m for m in llm.llm_engine.executor.model.modules() if isinstance(m, Attention)]
    assert {layer.backend.name for layer in layers} == {"flash_attn"}
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference
    assert fake.calls["flash_attn_varlen_func"] and fake.calls["flash_attn_with_kvcache"]


def test_decode_graphs_replay_flash_attn_decodes(tmp_path_factory, tiny_tokenizer_dir, monkeypatch):
    """Decode steps recorded once and replayed over static buffers (the CPU stands in for CUDA's
    capture, as tests/worker/test_decode_graphs.py does): padded rows read the pad block."""
    folder = str(_tiny_long_checkpoint(tmp_path_factory, tiny_tokenizer_dir))
    prompts = [[(7 * i + j) % 290 + 1 for j in range(n)] for i, n in enumerate((3, 270, 20))]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 9, 12)]
    args = dict(dtype="bfloat16", block_size=BLOCK, max_model_len=1024, kv_cache_memory="4MiB",
                max_num_seqs=4, max_num_batched_tokens=160)
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn.module())
    monkeypatch.setattr(CpuPlatform, "attention_backend", lambda self, *args: "flash_attn")
    # The reference: the same backend run eagerly (bf16 on a random model: another backend's
    # roundings can flip near-tied tokens).
    reference = [o.outputs[0].token_ids for o in LLM(folder, **args, enforce_eager=True).generate(prompts, params)]
    monkeypatch.setattr(CpuPlatform, "supports_graphs", True)
    monkeypatch.setattr(CpuPlatform, "capture_graph", lambda self, forward, state=(), first=True:
                        (forward(), forward)[1])
    monkeypatch.setattr(CpuPlatform, "graph_batch_limit", lambda self, kernels: 512)  # the stand-in records any size
    llm = LLM(folder, **args)
    graphs = llm.llm_engine.executor.runner.decode_graphs
    assert graphs is not None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference
    assert graphs.steps[4] and graphs.steps[1]  # 3 decodes padded to 4; the last one alone


@pytest.mark.parametrize("importable, block_size, kv_dtype, expected, why", [
    (True, 256, "bfloat16", "flash_attn", "block size 256, bfloat16 KV cache"),
    (True, 512, "float16", "flash_attn", "block size 512, float16 KV cache"),
    (True, 16, "bfloat16", "torch_sdpa", "multiple of 256; --block-size is 16"),
    (True, 256, "float32", "torch_sdpa", "float16 or bfloat16 KV cache, not float32"),
    (True, None, None, "torch_sdpa", "no block size"),
    (False, 256, "bfloat16", "torch_sdpa", "flash_attn does not import"),
])
def test_cuda_platform_picks_flash_attn_only_where_it_works(importable, block_size, kv_dtype, expected, why,
                                                           monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn.module() if importable else None)
    with caplog.at_level(logging.INFO, logger="tengyun.platforms.cuda.platform"):
        assert CudaPlatform().attention_backend(block_size, kv_dtype) == expected  # no GPU needed
    [record] = caplog.records
    assert record.getMessage().startswith(f"Attention backend: {expected} (") and why in record.getMessage()


def test_cuda_block_size_defaults_to_256_only_with_flash_attn(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn.module())
    assert CudaPlatform().default_block_size == 256
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    assert CudaPlatform().default_block_size == 16


def test_cpu_never_picks_flash_attn(tiny_checkpoints, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn.module())
    assert CpuPlatform().attention_backend(256, "bfloat16") in ("torch_sdpa", "cpu_paged")
    assert EngineConfig(model=str(tiny_checkpoints["llama"])).finalize().block_size == 16


def test_worker_asks_the_platform_with_the_block_size_and_kv_dtype(tiny_checkpoints, monkeypatch):
    asked = []
    monkeypatch.setattr(CpuPlatform, "attention_backend", lambda self, *args: asked.append(args) or "torch_sdpa")
    LLM(str(tiny_checkpoints["llama"]), dtype="float32", block_size=32, kv_cache_memory="1MiB", max_model_len=64)
    assert asked == [(32, "float32")]
