"""The tiled bfloat16 prefill attention kernel (tengyun/csrc/prefill_attention_bf16.cpp) against float32
attention computed here from the same cache, slot by slot (torch's einsum and softmax): fresh prompts
and chunks after cached tokens (past one 2,048-key span too), several chunks in one call, GQA / MQA /
MHA, head dims 32-128, block sizes 16 and 32, shuffled block tables; each query row's result does not
depend on how its prompt was chunked; bad arguments name what to fix; the cpu_paged backend sends
chunks of more than 16 query tokens to it where it runs. Skipped on CPUs without AVX512_BF16 (the
kernel never runs there)."""

from __future__ import annotations

import pytest
import torch

from tengyun.layers.attention.metadata import AttentionMetadata, PrefillChunk
from tengyun.platforms.attention_backends import get_attention_backend

from test_cpu_paged_attention import kernels  # noqa: F401 - the build-or-skip fixture


@pytest.fixture(scope="module")
def tiled(kernels):  # noqa: F811
    """The kernel op, once this checkout's library is built and the CPU runs it."""
    if not torch.ops.tengyun.prefill_attention_bf16_supported():
        pytest.skip("this CPU lacks AVX512_BF16")
    return torch.ops.tengyun.prefill_attention_bf16


def _case(chunks, heads, kv_heads, dim, block_size, seed=0):
    """chunks [(cached tokens, query tokens)] -> (q, k_cache, v_cache, block_tables, seq_lens,
    query_start_loc), bfloat16, each sequence in its own shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-(cached + n) // block_size) for cached, n in chunks]
    num_blocks = sum(widths) + 2
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(torch.bfloat16)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(chunks), max(widths), dtype=torch.int64)
    used = 0
    for row, width in enumerate(widths):
        tables[row, :width] = order[used:used + width]
        used += width
    seq_lens = torch.tensor([cached + n for cached, n in chunks])
    query_start_loc = torch.tensor([0] + [n for _, n in chunks]).cumsum(0)
    q = torch.randn(int(query_start_loc[-1]), heads, dim, generator=gen).to(torch.bfloat16)
    return q, k_cache, v_cache, tables, seq_lens, query_start_loc


def _reference(q, k_cache, v_cache, tables, seq_lens, query_start_loc, scale):
    """float32 causal attention: token i of a chunk of n sees its sequence's first len - (n - 1 - i) tokens."""
    heads, kv_heads, dim, block_size = q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for row, length in enumerate(seq_lens.tolist()):
        first, last = int(query_start_loc[row]), int(query_start_loc[row + 1])
        positions = torch.arange(length)
        slots = tables[row, positions // block_size] * block_size + positions % block_size
        keys = k_cache.view(-1, kv_heads, dim)[slots].float().repeat_interleave(heads // kv_heads, 1)
        values = v_cache.view(-1, kv_heads, dim)[slots].float().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("thd,khd->htk", q[first:last].float(), keys) * scale
        limits = length - (last - first) + torch.arange(last - first) + 1
        scores.masked_fill_(positions[None, None, :] >= limits[None, :, None], float("-inf"))
        out[first:last] = torch.einsum("htk,khd->thd", scores.softmax(-1), values)
    return out


def _run(kernel, q, k_cache, v_cache, tables, seq_lens, query_start_loc, scale):
    out = torch.empty_like(q)
    kernel(out, q, k_cache, v_cache, tables, seq_lens, scale, query_start_loc)
    return out


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (14, 2, 64), (6, 2, 128), (4, 4, 32), (8, 1, 96),
                                                (16, 8, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("chunks", [[(0, 128)] * 4, [(0, 17)], [(100, 50), (0, 33), (7, 200), (31, 1)],
                                    [(0, 600)], [(1500, 40)], [(2100, 300), (4000, 20)]])
def test_the_kernel_attends_as_float32_attention_does(tiled, heads, kv_heads, dim, block_size, chunks):
    """Every row within a bfloat16 rounding of the float32 result (the softmax and both sums are
    float32; the scores' products exact), and all but 0.1% of the elements exactly its rounding (measured
    0.014-0.052%, as the paged kernel: bfloat16 outputs near a rounding boundary)."""
    case = _case(chunks, heads, kv_heads, dim, block_size, seed=heads + dim + block_size)
    expected = _reference(*case, dim ** -0.5)
    got = _run(tiled, *case, dim ** -0.5)
    torch.testing.assert_close(got.float(), expected, atol=1.6e-2, rtol=1e-2)
    assert (got != expected.to(torch.bfloat16)).float().mean() < 0.001


def test_a_rows_result_does_not_depend_on_how_its_prompt_was_chunked(tiled):
    """A 300-token prompt in one chunk, in chunks of 100 (the later ones after cached tokens), and
    beside other sequences in one call: the same bits per token (a row depends only on its query,
    its causal limit and the cache)."""
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    q, k_cache, v_cache, tables, seq_lens, qsl = _case([(0, 300)], heads, kv_heads, dim, block_size, seed=3)
    whole = _run(tiled, q, k_cache, v_cache, tables, seq_lens, qsl, 0.125)
    for start in (0, 100, 200):
        part = _run(tiled, q[start:start + 100].contiguous(), k_cache, v_cache, tables, torch.tensor([start + 100]),
                    torch.tensor([0, 100]), 0.125)
        assert torch.equal(part, whole[start:start + 100])
    other = _case([(0, 64)], heads, kv_heads, dim, block_size, seed=4)
    together = torch.cat([q, other[0]])
    tables2 = torch.zeros(2, tables.shape[1], dtype=torch.int64)
    k2, v2 = torch.cat([k_cache, other[1]]), torch.cat([v_cache, other[2]])
    tables2[0] = tables[0]
    tables2[1, :other[3].shape[1]] = other[3][0] + k_cache.shape[0]
    both = _run(tiled, together, k2, v2, tables2, torch.tensor([300, 64]), torch.tensor([0, 300, 364]), 0.125)
    assert torch.equal(both[:300], whole)


def test_bad_arguments_name_what_to_fix(tiled):
    q, k_cache, v_cache, tables, seq_lens, qsl = _case([(0, 20)], 4, 2, 64, 16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        _run(tiled, q.float(), k_cache, v_cache, tables, seq_lens, qsl, 0.125)
    with pytest.raises(RuntimeError, match="multiple of 32 up to 128"):
        _run(tiled, q[..., :48].contiguous(), k_cache[..., :48].contiguous(), v_cache[..., :48].contiguous(), tables,
             seq_lens, qsl, 0.125)
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = 10 must hold its 20 query tokens"):
        _run(tiled, q, k_cache, v_cache, tables, torch.tensor([10]), qsl, 0.125)


@pytest.fixture
def without_amx(monkeypatch):
    """cpu_paged's routing as on this CPU with AMX's flags hidden (the tiled kernel is for CPUs without AMX)."""
    from tengyun.platforms.cpu.kernels import attention

    flags = attention.cpu_flags() - {"amx_bf16", "amx_tile", "amx_int8"}
    monkeypatch.setattr(attention, "cpu_flags", lambda: flags)
    attention._has_amx_bf16.cache_clear()
    attention._has_avx512_bf16.cache_clear()
    yield
    monkeypatch.undo()
    attention._has_amx_bf16.cache_clear()
    attention._has_avx512_bf16.cache_clear()


def test_the_backend_sends_chunks_over_16_tokens_to_the_tiled_kernel(tiled, without_amx):
    """One bfloat16 step: a 5-token verify after 40 cached tokens stays a decode-row chunk (the
    paged kernel), a fresh 40-token prompt and a 300-token chunk after 1,100 cached tokens (over the
    paged kernel's 1,024 limit, torch_sdpa's before) go to the tiled kernel; every token equals
    torch_sdpa's within bfloat16 tolerance."""
    heads, kv_heads, dim, block_size = 14, 2, 64, 16
    chunks = [(40, 5), (0, 40), (1100, 300)]
    q, k_cache, v_cache, tables, seq_lens, qsl = _case(chunks, heads, kv_heads, dim, block_size, seed=9)
    prefills = [PrefillChunk(int(qsl[i]), n, cached, tables[i, :-(-(cached + n) // block_size)])
                for i, (cached, n) in enumerate(chunks)]
    positions = [torch.arange(c, c + n) for c, n in chunks]
    slots = torch.cat([tables[i, p // block_size] * block_size + p % block_size for i, p in enumerate(positions)])
    k = k_cache.view(-1, kv_heads, dim)[slots]
    v = v_cache.view(-1, kv_heads, dim)[slots]
    metas = {name: AttentionMetadata(slot_mapping=slots, num_decode_tokens=0, prefills=prefills)
             for name in ("cpu_paged", "torch_sdpa")}
    out = {name: get_attention_backend(name).forward(q, k, v, k_cache, v_cache, meta, dim ** -0.5)
           for name, meta in metas.items()}
    step = metas["cpu_paged"].backend_state["kernel_chunks"]
    assert step.paged.seq_lens.tolist() == [45] and step.tiled.seq_lens.tolist() == [40, 1400] and not step.others
    torch.testing.assert_close(out["cpu_paged"], out["torch_sdpa"], atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out["cpu_paged"].float(), _reference(q, k_cache, v_cache, tables, seq_lens, qsl,
                                                                    dim ** -0.5), atol=1.6e-2, rtol=1e-2)


def test_the_attention_choice_names_the_tiled_kernel_where_it_runs(tiled, without_amx):
    """The engine's "Attention backend" line says bfloat16 prompt chunks run in the tiled kernel; in
    float32 it names only the decode kernel."""
    from tengyun.platforms.cpu.platform import CpuPlatform
    from tengyun.platforms.kernel_choice import KernelQuery

    def detail(dtype):
        query = KernelQuery(dtype, 16, dtype)
        return CpuPlatform.choose_kernel("attention", query).candidate.describe(query)

    assert detail("bfloat16").endswith("; prompt chunks over 16 tokens in the tiled bfloat16 kernel")
    assert "tiled" not in detail("float32")
