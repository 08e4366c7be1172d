"""The compiled CPU decode kernel (cpu_paged, tengyun/csrc/paged_attention.cpp) against
scaled_dot_product_attention over each sequence's own context (test_decode_attention.py's
reference): random shapes with odd head counts and head dims, GQA / MQA / MHA, contexts that end
inside a block, length 1, block sizes 16 and 128, float32 / bfloat16 / float16 caches, on every
instruction-set copy this CPU can run; several causal query tokens per sequence (a speculative
verify) equal one decode row per token. Then the engine on it (the same greedy tokens as torch_sdpa),
and the fallback when the library is missing or broken (a fresh process: torch_sdpa, one log line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tengyun import LLM, SamplingParams
from tengyun.platforms.cpu import native as cpu_kernels
from tengyun.layers.attention.layer import Attention
from tengyun.layers.attention.metadata import AttentionMetadata
from tengyun.platforms.attention_backends import get_attention_backend
from tengyun.platforms.cpu.platform import CpuPlatform

from test_decode_attention import _reference

ISAS = ("avx512", "avx2", "generic")
SHAPES = [  # (query heads, KV heads, head dim)
    (9, 3, 64),  # SmolLM2: GQA groups of 3
    (7, 7, 32),  # MHA, odd
    (14, 2, 64),  # Qwen2.5-0.5B
    (5, 1, 24),  # MQA, head dim not a multiple of the vector width
    (6, 2, 128),  # Qwen3
    (3, 3, 17),  # odd head dim
]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


@pytest.fixture(scope="module")
def kernels():
    """The kernels of this checkout, built first when they are not (a cached build takes < 1 s)."""
    if cpu_kernels.load_error() is not None:
        missing = cpu_kernels.build_tools_missing()
        if missing:
            pytest.skip(f"cannot build the CPU kernels here: {missing}")
        cpu_kernels.build()
        cpu_kernels.load_error.cache_clear()
    assert cpu_kernels.load_error() is None
    return cpu_kernels


@pytest.fixture(params=ISAS)
def isa(request, kernels):
    """Each instruction-set copy this CPU has; the best one again afterwards."""
    best = kernels.isa()
    try:
        torch.ops.tengyun.paged_attention_isa(request.param)
    except RuntimeError:
        pytest.skip(f"this CPU lacks {request.param}")
    yield request.param
    torch.ops.tengyun.paged_attention_isa(best)


def _random_case(heads, kv_heads, dim, block_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor([1, block_size - 1, block_size, block_size + 1, 2 * block_size + 5, 3])
    blocks_needed = -(-int(lens.max()) // block_size)
    num_blocks = lens.numel() * blocks_needed + 3
    # Each sequence its own blocks, in a shuffled order; rows padded with block 0 past their length.
    tables = torch.randperm(num_blocks, generator=gen)[: lens.numel() * blocks_needed].view(-1, blocks_needed)
    for row, length in enumerate(lens.tolist()):
        tables[row, -(-length // block_size):] = 0
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(lens.numel(), heads, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
def test_kernel_matches_sdpa_per_sequence(isa, heads, kv_heads, dim, block_size, dtype):
    q, k_cache, v_cache, tables, lens = _random_case(heads, kv_heads, dim, block_size, dtype, heads * dim + block_size)
    out = torch.full_like(q, float("nan"))
    cpu_kernels.paged_decode_attention(out, q, k_cache, v_cache, tables, lens, dim ** -0.5)
    torch.testing.assert_close(out.float(), _reference(q, k_cache, v_cache, tables, lens, dim ** -0.5),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def _shuffled_cache(lens, block_size, kv_heads, dim, dtype, gen):
    """(tables [B, most blocks], k_cache, v_cache): each sequence's blocks drawn at random from one
    shared cache of random K/V, exactly as many as its length needs."""
    blocks = -(-lens // block_size)
    tables = torch.zeros(lens.numel(), int(blocks.max()), dtype=torch.int64)
    order = torch.randperm(int(blocks.sum()), generator=gen)
    for row, (start, n) in enumerate(zip((blocks.cumsum(0) - blocks).tolist(), blocks.tolist())):
        tables[row, :n] = order[start:start + n]
    k_cache = torch.randn(int(blocks.sum()), block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(int(blocks.sum()), block_size, kv_heads, dim, generator=gen).to(dtype)
    return tables, k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (14, 2, 64), (5, 1, 24)])
def test_a_large_batch_gives_each_sequence_what_it_gets_alone(isa, heads, kv_heads, dim, dtype):
    """From 4 sequences per thread one thread attends a sequence's KV heads in turn while the next
    sequence it claimed streams into L2 (paged_attention_impl.h attend_sequences, NextRows) where
    both sequences' K/V fit; the longest one here does not, so its neighbours neither stream it nor
    are streamed after it. Same bits as each sequence decoded alone."""
    block_size, threads = 16, torch.get_num_threads()
    gen = torch.Generator().manual_seed(heads * dim)
    lens = torch.tensor([1, 15, 16, 17, 40, 3, 2200, 100] * threads)
    tables, k_cache, v_cache = _shuffled_cache(lens, block_size, kv_heads, dim, dtype, gen)
    q = torch.randn(lens.numel(), heads, dim, generator=gen).to(dtype)
    together = torch.full_like(q, float("nan"))
    cpu_kernels.paged_decode_attention(together, q, k_cache, v_cache, tables, lens, dim ** -0.5)
    for b in range(lens.numel()):
        alone = torch.full_like(q[b:b + 1], float("nan"))
        cpu_kernels.paged_decode_attention(alone, q[b:b + 1], k_cache, v_cache, tables[b:b + 1], lens[b:b + 1],
                                           dim ** -0.5)
        assert torch.equal(together[b:b + 1], alone), b
    torch.testing.assert_close(together.float(), _reference(q, k_cache, v_cache, tables, lens, dim ** -0.5),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_batch_of_verify_chunks_gives_each_what_it_gets_alone(isa, dtype):
    """Several query tokens per sequence (speculative verifies) in a batch large enough for whole
    sequences per thread and the next one streamed in: each chunk's rows are the bits it gets alone."""
    heads, kv_heads, dim, block_size, threads = 9, 3, 64, 16, torch.get_num_threads()
    gen = torch.Generator().manual_seed(7)
    lens = torch.tensor([5, 33, 16, 300, 2, 130] * 2 * threads)
    counts = torch.tensor([1, 4, 3, 5, 2, 3] * 2 * threads)
    tables, k_cache, v_cache = _shuffled_cache(lens, block_size, kv_heads, dim, dtype, gen)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    q = torch.randn(int(starts[-1]), heads, dim, generator=gen).to(dtype)
    together = torch.full_like(q, float("nan"))
    cpu_kernels.paged_decode_attention(together, q, k_cache, v_cache, tables, lens, dim ** -0.5, starts)
    for b in range(lens.numel()):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        alone = torch.full_like(q[rows], float("nan"))
        cpu_kernels.paged_decode_attention(alone, q[rows], k_cache, v_cache, tables[b:b + 1], lens[b:b + 1],
                                           dim ** -0.5, torch.tensor([0, int(counts[b])]))
        assert torch.equal(together[rows], alone), b


def _multi_query_case(heads, kv_heads, dim, block_size, dtype, seed):
    """_random_case's sequences, each with 1 .. 5 query tokens (a verify: the last token and up to
    4 drafts), flat -> (q [T, Hq, D], caches, tables, lens, query_start_loc [B + 1]); and the same
    as one decode row per query token: (tables [T, nb], lens [T]) with token i of n seeing
    lens[b] - (n - 1 - i) tokens."""
    _, k_cache, v_cache, tables, lens = _random_case(heads, kv_heads, dim, block_size, dtype, seed)
    counts = torch.tensor([1, 4, 3, 5, 2, 3]).clamp(max=lens)  # never more query tokens than context
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(int(starts[-1]), heads, dim, generator=gen).to(dtype)
    row_lens = torch.cat([lens[b] - torch.arange(n - 1, -1, -1) for b, n in enumerate(counts.tolist())])
    return q, k_cache, v_cache, tables, lens, starts, tables.repeat_interleave(counts, dim=0), row_lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
def test_several_query_tokens_per_sequence_are_causal_decode_rows(isa, heads, kv_heads, dim, block_size, dtype):
    """query_start_loc: each sequence's K/V blocks read once for all its query tokens, each token
    over its own causal prefix; bit for bit the decode kernel on one row per token, and SDPA's."""
    q, k_cache, v_cache, tables, lens, starts, row_tables, row_lens = _multi_query_case(
        heads, kv_heads, dim, block_size, dtype, heads * dim + block_size)
    _assert_chunks_are_decode_rows(q, k_cache, v_cache, tables, lens, starts, row_tables, row_lens, dtype)


def _assert_chunks_are_decode_rows(q, k_cache, v_cache, tables, lens, starts, row_tables, row_lens, dtype):
    """The kernel over chunks (query_start_loc ``starts``) equals it over one row per query token
    (row_tables / row_lens: each token's causal limit) bit for bit, and SDPA within TOLERANCE."""
    scale = q.shape[-1] ** -0.5
    out, rows = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    cpu_kernels.paged_decode_attention(out, q, k_cache, v_cache, tables, lens, scale, starts)
    cpu_kernels.paged_decode_attention(rows, q, k_cache, v_cache, row_tables, row_lens, scale)
    torch.testing.assert_close(out, rows, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), _reference(q, k_cache, v_cache, row_tables, row_lens, scale),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (5, 1, 24)])
@pytest.mark.parametrize("lens,counts", [([128], [128]), ([340], [300]), ([560, 48], [500, 48])])
def test_a_few_long_chunks_split_in_pieces_are_decode_rows(isa, heads, kv_heads, dim, dtype, lens, counts):
    """With fewer sequences than the threads can share out whole, each chunk's query tokens are
    attended in pieces of about equal causal work (paged_attention_threads.h split_queries): a
    fresh 128-token prompt, 300 tokens after 40 cached, and 500 after 60 (across the 512-token span
    edge) beside a 48-token prompt equal decode rows bit for bit, and SDPA."""
    block_size = 16
    gen = torch.Generator().manual_seed(sum(lens) + heads)
    lens, counts = torch.tensor(lens), torch.tensor(counts)
    per_seq = -(-int(lens.max()) // block_size)
    tables = torch.randperm(lens.numel() * per_seq, generator=gen).view(-1, per_seq)
    k_cache = torch.randn(tables.numel(), block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(tables.numel(), block_size, kv_heads, dim, generator=gen).to(dtype)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    q = torch.randn(int(starts[-1]), heads, dim, generator=gen).to(dtype)
    row_lens = torch.cat([lens[b] - torch.arange(n - 1, -1, -1) for b, n in enumerate(counts.tolist())])
    _assert_chunks_are_decode_rows(q, k_cache, v_cache, tables, lens, starts, tables.repeat_interleave(counts, dim=0),
                                   row_lens, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (14, 2, 64), (5, 1, 24)])
def test_contexts_longer_than_a_span_and_chunks_across_its_edge(isa, heads, kv_heads, dim, block_size, dtype):
    """The kernel holds 512 tokens' scores at a time (paged_attention_impl.h kSpanTokens) and
    rescales between spans: contexts of 2-3 spans, and chunks whose tokens end on both sides of
    token 512 (limits 510..514: the last ones see none of the second span) equal decode rows bit
    for bit, and SDPA."""
    gen = torch.Generator().manual_seed(heads + block_size)
    lens = torch.tensor([514, 1100, 512, 513, 700])
    counts = torch.tensor([5, 1, 3, 16, 2])  # 514 with 5 tokens: limits 510 .. 514
    per_seq = -(-int(lens.max()) // block_size)
    num_blocks = lens.numel() * per_seq
    tables = torch.randperm(num_blocks, generator=gen).view(-1, per_seq)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    q = (3 * torch.randn(int(starts[-1]), heads, dim, generator=gen)).to(dtype)  # peaked: max shifts between spans
    row_lens = torch.cat([lens[b] - torch.arange(n - 1, -1, -1) for b, n in enumerate(counts.tolist())])
    row_tables = tables.repeat_interleave(counts, dim=0)
    _assert_chunks_are_decode_rows(q, k_cache, v_cache, tables, lens, starts, row_tables, row_lens, dtype)


@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_query_and_cache_dtypes_may_differ(kernels, q_dtype, cache_dtype):
    q, k_cache, v_cache, tables, lens = _random_case(9, 3, 64, 16, cache_dtype, 7)
    q = q.to(q_dtype)
    out = torch.empty_like(q)
    kernels.paged_decode_attention(out, q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(out.float(), _reference(q, k_cache, v_cache, tables, lens, 0.125), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_backend_decodes_as_torch_sdpa_does(kernels, threads):
    """Through AttentionMetadata, in decode_max_len's static form too; any thread count."""
    q, k_cache, v_cache, tables, lens = _random_case(14, 2, 64, 16, torch.float32, 3)
    backend, reference = get_attention_backend("cpu_paged"), get_attention_backend("torch_sdpa")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for static_len in (None, tables.shape[1] * 16):
            meta = AttentionMetadata(slot_mapping=torch.zeros(6, dtype=torch.int64), num_decode_tokens=6,
                                     decode_block_tables=tables, decode_seq_lens=lens, decode_max_len=static_len)
            torch.testing.assert_close(backend._decode(q, k_cache, v_cache, meta, 0.3),
                                       reference._decode(q, k_cache, v_cache, meta, 0.3))
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def cpu_flags_as(monkeypatch):
    """Call with a set of /proc/cpuinfo flags: cpu_paged's limits are then chosen as on such a CPU."""
    from tengyun.platforms.cpu.kernels import attention

    def pretend(flags: set[str]) -> None:
        monkeypatch.setattr(attention, "cpu_flags", lambda: flags)
        attention._has_amx_bf16.cache_clear()
        attention._has_avx512_bf16.cache_clear()

    yield pretend
    monkeypatch.undo()
    attention._has_amx_bf16.cache_clear()
    attention._has_avx512_bf16.cache_clear()


def test_bfloat16_on_amx_cores_leaves_chunks_over_32_tokens_to_sdpa(cpu_flags_as):
    """With AMX, torch's SDPA multiplies bfloat16 on tiles and wins from ~48 query tokens, so the
    kernel keeps only chunks of up to 32; float32, and bfloat16 without AMX, keep the generic limits
    (16 query tokens, or a whole sequence of up to 512 in float32, 1024 in bfloat16)."""
    from tengyun.platforms.cpu.kernels.attention import in_kernel
    from tengyun.layers.attention.metadata import PrefillChunk

    chunks = [(3, 20), (32, 200), (33, 0), (40, 0), (128, 128), (200, 0), (300, 300), (600, 400), (900, 200)]

    def picks(dtype):
        return [in_kernel(PrefillChunk(0, n, context, torch.zeros(1, dtype=torch.int64)), dtype)
                for n, context in chunks]

    cpu_flags_as({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"})
    assert picks(torch.bfloat16) == [True, True, False, False, False, False, False, False, False]
    assert picks(torch.float32) == [True, True, True, True, True, True, False, False, False]
    cpu_flags_as({"avx512f", "avx512_bf16"})
    assert picks(torch.bfloat16) == [True, True, True, True, True, True, True, True, False]
    assert picks(torch.float32) == [True, True, True, True, True, True, False, False, False]


@pytest.mark.parametrize("flags,in_the_kernel", [({"avx512f", "avx512_bf16", "amx_bf16"}, False),
                                                  ({"avx512f", "avx512_bf16"}, True)])
def test_the_backend_routes_a_bfloat16_prompt_by_the_cpus_limits(kernels, cpu_flags_as, flags, in_the_kernel):
    """A fresh 40-token bfloat16 prompt: SDPA's with AMX; without, the tiled prefill kernel's where
    this CPU runs it (AVX512_BF16), else the paged kernel's; the same tokens every way."""
    from tengyun.layers.attention.metadata import PrefillChunk

    gen, bs, n, heads, kv_heads, dim = torch.Generator().manual_seed(7), 16, 40, 9, 3, 64
    q = torch.randn(n, heads, dim, generator=gen).to(torch.bfloat16)
    k = torch.randn(n, kv_heads, dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(n, kv_heads, dim, generator=gen).to(torch.bfloat16)
    table = torch.tensor([2, 0, 1])
    slots = table[torch.arange(n) // bs] * bs + torch.arange(n) % bs
    k_cache = torch.zeros(3, bs, kv_heads, dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k_cache.view(-1, kv_heads, dim)[slots], v_cache.view(-1, kv_heads, dim)[slots] = k, v
    cpu_flags_as(flags)
    metas = {name: AttentionMetadata(slot_mapping=slots, num_decode_tokens=0, prefills=[PrefillChunk(0, n, 0, table)])
             for name in ("cpu_paged", "torch_sdpa")}
    out = {name: get_attention_backend(name).forward(q, k, v, k_cache, v_cache, meta, dim ** -0.5)
           for name, meta in metas.items()}
    step = metas["cpu_paged"].backend_state["kernel_chunks"]
    tiled_here = in_the_kernel and bool(torch.ops.tengyun.prefill_attention_bf16_supported())
    assert (step.tiled is not None, step.paged is not None, bool(step.others)) == (
        tiled_here, in_the_kernel and not tiled_here, not in_the_kernel)
    torch.testing.assert_close(out["cpu_paged"], out["torch_sdpa"], atol=TOLERANCE[torch.bfloat16],
                               rtol=TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backend_runs_its_chunks_in_the_kernel_as_torch_sdpa_attends(kernels, dtype, cpu_flags_as):
    """One step: 2 decodes, then chunks (query tokens, cached before them): a 3-token verify over
    20 cached tokens, a 20-token chunk after 1100 (torch_sdpa's path), a 2-token fresh prompt, a
    5-token verify ending inside a block, a 40-token fresh prompt and a 30-token chunk after 60
    (short sequences: the kernel's; the generic limits, as on a CPU without AMX). The kernel's rows
    are not contiguous. Every token equals torch_sdpa's."""
    from tengyun.platforms.cpu.kernels.attention import in_kernel
    from tengyun.layers.attention.metadata import PrefillChunk

    gen, bs, heads, kv_heads, dim = torch.Generator().manual_seed(5), 16, 14, 2, 64
    k_cache = torch.randn(576, bs, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(576, bs, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(576, generator=gen).view(8, 72)  # one row of blocks per sequence
    decode_lens = torch.tensor([7, 33])
    chunks = [(3, 20), (20, 1100), (2, 0), (5, 28), (40, 0), (30, 60)]
    cpu_flags_as({"avx512f", "avx512_bf16"})
    assert [in_kernel(PrefillChunk(0, n, context, tables[0]), dtype) for n, context in chunks] == [
        True, False, True, True, True, True]
    prefills, slots, start = [], [], 2
    for i, (n, context) in enumerate(chunks):
        table = tables[2 + i]
        prefills.append(PrefillChunk(start, n, context, table[:-(-(context + n) // bs)]))
        slots += [int(table[p // bs]) * bs + p % bs for p in range(context, context + n)]
        start += n
    q = torch.randn(start, heads, dim, generator=gen).to(dtype)
    slots = torch.tensor([int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(decode_lens)] + slots)
    k = k_cache.view(-1, kv_heads, dim)[slots]  # this step's K/V: what the cache holds at their slots
    v = v_cache.view(-1, kv_heads, dim)[slots]

    def run(name):
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=2, decode_block_tables=tables[:2],
                                 decode_seq_lens=decode_lens, prefills=prefills)
        return get_attention_backend(name).forward(q, k, v, k_cache, v_cache, meta, dim ** -0.5)

    torch.testing.assert_close(run("cpu_paged"), run("torch_sdpa"), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_bad_arguments_name_what_to_fix(kernels):
    q, k_cache, v_cache, tables, lens = _random_case(4, 2, 16, 16, torch.float32, 0)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="query_start_loc must be non-decreasing within q's 6 rows"):
        kernels.paged_decode_attention(out, q, k_cache, v_cache, tables, lens, 1.0, torch.tensor([0, 4, 2]))
    with pytest.raises(RuntimeError, match=r"sequence 0 has 3 query tokens but seq_lens\[0\] = 1"):
        kernels.paged_decode_attention(out, q, k_cache, v_cache, tables, lens, 1.0, torch.tensor([0, 3, 6]))
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = 1000 outside"):
        kernels.paged_decode_attention(out, q, k_cache, v_cache, tables, torch.full_like(lens, 1000), 1.0)
    with pytest.raises(RuntimeError, match="block_tables must be int64"):
        kernels.paged_decode_attention(out, q, k_cache, v_cache, tables.int(), lens, 1.0)
    with pytest.raises(RuntimeError, match="Hq be a multiple of Hkv"):
        kernels.paged_decode_attention(out[:, :3].contiguous(), q[:, :3].contiguous(), k_cache, v_cache, tables, lens,
                                       1.0)


def test_cpu_platform_picks_cpu_paged_and_the_engine_gives_torch_sdpas_tokens(kernels, tiny_checkpoints,
                                                                             monkeypatch, caplog):
    folder = str(tiny_checkpoints["qwen2"])
    prompts = [[5, 6, 7], [(3 * i) % 300 + 1 for i in range(40)], list(range(1, 20))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    args = dict(block_size=8, max_model_len=96, kv_cache_memory="1MiB")
    with caplog.at_level("INFO", logger="tengyun.platforms.cpu.platform"):
        llm = LLM(folder, dtype="float32", **args)
    assert f"Attention backend: cpu_paged (compiled decode kernel, {kernels.isa()})" in caplog.text
    assert {m.backend.name for m in llm.llm_engine.executor.model.modules() if isinstance(m, Attention)} == {
        "cpu_paged"}
    got = llm.generate(prompts, params)
    monkeypatch.setattr(CpuPlatform, "attention_backend", lambda self, *args: "torch_sdpa")
    want = LLM(folder, dtype="float32", **args).generate(prompts, params)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for got_top, want_top in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            for token, entry in want_top.items():
                assert got_top[token].logprob == pytest.approx(entry.logprob, abs=1e-4)


FRESH_PROCESS = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    from tengyun import LLM, SamplingParams
    from tengyun.layers.attention.layer import Attention
    llm = LLM(sys.argv[1], dtype="float32", block_size=8, max_model_len=64, kv_cache_memory="1MiB")
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    worker = llm.llm_engine.executor
    names = sorted({m.backend.name for m in worker.model.modules() if isinstance(m, Attention)})
    ops = type(worker.kernels.layer_ops).__name__
    print(json.dumps({"backends": names, "layer_ops": ops, "tokens": out[0].outputs[0].token_ids,
                      "sample_rows": worker.runner.sampler.sample_rows is not None}))
""")


@pytest.mark.parametrize("library", ["missing", "broken"])
def test_without_a_loadable_library_the_pytorch_path_runs_and_says_why(tiny_checkpoints, tmp_path, library):
    """A fresh process whose kernel folder holds nothing, or a file that is no shared library."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    expected = {"missing": "the CPU kernels are not built", "broken": "failed to load"}[library]
    if library == "broken":
        probe = "from tengyun.platforms.cpu import native; print(native.library_path())"
        path = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        broken = Path(path.stdout.strip())
        broken.parent.mkdir(parents=True)
        broken.write_bytes(b"not an ELF file")
    folder = str(tiny_checkpoints["llama"])
    run = subprocess.run([sys.executable, "-c", FRESH_PROCESS, folder], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["backends"] == ["torch_sdpa"] and result["layer_ops"] == "TorchLayerOps"
    assert result["sample_rows"] is False  # the sampler's PyTorch ops
    [line] = [line for line in run.stderr.splitlines() if "Attention backend:" in line]
    assert line.startswith("tengyun.platforms.cpu.platform: Attention backend: torch_sdpa (") and expected in line
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert result["tokens"] == LLM(folder, dtype="float32", block_size=8, max_model_len=64,
                                   kv_cache_memory="1MiB").generate(
        [[5, 6, 7, 8]], params)[0].outputs[0].token_ids
