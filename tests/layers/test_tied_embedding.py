"""A tied LM head on CPU holds the vocab x hidden matrix once: oneDNN's packed copy computes the
logits and serves the embedding's lookups (packed_gemv.cpp's packed_rows, bit for bit F.embedding),
and the plain weight is freed. Where the small-batch kernel is absent or rejects the layout, the
embedding keeps its own copy as before. Engine tokens and logprobs are unchanged either way."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tengyun import LLM, SamplingParams
from tengyun.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from tengyun.layers.kernels import bind_kernels
from tengyun.layers.linear_kernel import onednn_available
from tengyun.platforms.cpu.kernels import linear as cpu_linear
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.platforms.cpu.kernels.linear import CpuPackedLinearKernel, small_batch_kernel_fits
from tengyun.worker.worker import weight_bytes

from test_cpu_linear import fits  # noqa: F401 - skips a dtype the small-batch kernel does not run here
from test_cpu_paged_attention import kernels  # noqa: F401 - the build-or-skip fixture

DTYPES = [torch.float32, torch.bfloat16]


def _ids(vocab: int, count: int, seed: int) -> torch.Tensor:
    """count random ids in [0, vocab), the first and last row among them."""
    ids = torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed))
    ids[0], ids[-1] = 0, vocab - 1
    return ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,hidden", [(1000, 576), (49, 33), (197, 64), (64, 7), (3, 2)])
def test_packed_rows_equal_f_embedding_bit_for_bit(fits, dtype, vocab, hidden):  # noqa: F811
    weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    kernel = CpuPackedLinearKernel(dtype)
    prepared = kernel.prepare(weight)
    assert prepared.data_ptr is not None
    read = kernel.row_reader(prepared, weight)
    assert read is not None
    for ids in (_ids(vocab, 37, hidden), _ids(vocab, 6, 1).view(2, 3), torch.arange(vocab).int()):
        rows = read(ids)
        assert rows.dtype == dtype and rows.shape == (*ids.shape, hidden)
        assert torch.equal(rows, F.embedding(ids.long(), weight))
    assert read(torch.empty(0, dtype=torch.long)).shape == (0, hidden)
    with pytest.raises(RuntimeError, match="outside"):
        read(torch.tensor([vocab]))


def _tied_pair(vocab: int, hidden: int, dtype: torch.dtype) -> tuple[torch.nn.ModuleDict, torch.Tensor]:
    """{embed, head} sharing one random [vocab, hidden] weight, and a copy of it."""
    embedding = VocabParallelEmbedding(vocab, hidden, dtype)
    embedding.weight.data.copy_(torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(3)).to(dtype))
    head = ParallelLMHead(vocab, hidden, dtype)
    head.tie_to(embedding)
    pair = torch.nn.ModuleDict(dict(embed=embedding, head=head))
    return pair, embedding.weight.data.clone()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tied_head_frees_the_embeddings_weight_and_serves_its_lookups(fits, dtype):  # noqa: F811
    vocab, hidden = 197, 48
    pair, weight = _tied_pair(vocab, hidden, dtype)
    before = weight_bytes(pair)  # the one plain weight
    bind_kernels(pair, CpuPlatform().kernels(dtype, 16, "float32"))
    assert pair.embed.weight.numel() == 0 and pair.head.weight.numel() == 0
    assert weight_bytes(pair) == before == vocab * hidden * weight.element_size()  # the packed copy only
    ids = _ids(vocab, 20, 0)
    assert torch.equal(pair.embed(ids), F.embedding(ids, weight))
    x = torch.randn(3, hidden).to(dtype)
    torch.testing.assert_close(pair.head.compute_logits(x).float(), F.linear(x.float(), weight.float()),
                               rtol=2 ** -7, atol=2e-2)


def test_the_bfloat16_weight_kernels_packed_copy_serves_the_lookups(kernels, monkeypatch):  # noqa: F811
    """Where oneDNN packs no bfloat16 weight (AVX2; made so here), a tied head's packed copy (16-column
    blocks) serves the embedding's lookups bit for bit and the plain weight is freed: one vocab x
    hidden matrix for both, as tied_head_copy tells the plan."""
    from tengyun.platforms.cpu.kernels import choice
    from tengyun.platforms.cpu.kernels.bf16_weights import bf16_weight_kernel_fits

    if not bf16_weight_kernel_fits():
        pytest.skip("this CPU does not run the AVX2 bfloat16-weight kernel")
    monkeypatch.setattr(choice, "_why_not_small_batch", lambda q: "held off by the test")
    monkeypatch.setattr(choice, "_why_not_onednn", lambda q: "held off by the test")
    vocab, hidden = 208, 48
    pair, weight = _tied_pair(vocab, hidden, torch.bfloat16)
    bind_kernels(pair, CpuPlatform().kernels("bfloat16", 16, "float32"))
    assert type(pair.head.kernel).__name__ == "CpuBf16WeightKernel"
    assert pair.embed.weight.numel() == 0 and pair.head.weight.numel() == 0
    assert weight_bytes(pair) == vocab * hidden * 2  # the packed copy only
    for ids in (_ids(vocab, 20, 0), torch.arange(vocab), _ids(vocab, 6, 1).view(2, 3)):
        assert torch.equal(pair.embed(ids), F.embedding(ids, weight))
    x = torch.randn(3, hidden).to(torch.bfloat16)
    torch.testing.assert_close(pair.head.compute_logits(x).float(), F.linear(x.float(), weight.float()),
                               rtol=2 ** -7, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fallback", ["kernels absent", "layout rejected"])
def test_without_the_packed_rows_the_embedding_keeps_its_copy(kernels, monkeypatch, dtype, fallback):  # noqa: F811
    if not onednn_available(dtype):
        pytest.skip(f"no oneDNN {dtype} linear here")
    if fallback == "kernels absent":
        monkeypatch.setattr(cpu_linear, "small_batch_kernel_fits", lambda dtype: False)
    elif small_batch_kernel_fits(dtype):
        monkeypatch.setattr(CpuPackedLinearKernel, "_reads_like_onednn", lambda *args: False)
    else:
        pytest.skip(f"this CPU does not run the small-batch kernel for {dtype}")
    vocab, hidden = 197, 48
    pair, weight = _tied_pair(vocab, hidden, dtype)
    bind_kernels(pair, CpuPlatform().kernels(dtype, 16, "float32"))
    assert pair.embed.row_reader is None and torch.equal(pair.embed.weight.data, weight)
    assert weight_bytes(pair) == 2 * vocab * hidden * weight.element_size()  # plain and packed
    ids = _ids(vocab, 20, 0)
    assert torch.equal(pair.embed(ids), F.embedding(ids, weight))


def _generate(folder, dtype: str) -> tuple[list, int, bool]:
    llm = LLM(str(folder), dtype=dtype, block_size=16, max_model_len=128, kv_cache_memory="4MiB")
    model = llm.llm_engine.executor.model
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompts = [[5, 17, 33], [2, 40, 7, 9, 11]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    served = model.model.embed_tokens.row_reader is not None
    return ([(o.outputs[0].token_ids, [dict(d) for d in o.outputs[0].logprobs]) for o in outs],
            weight_bytes(model), served)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_tokens_and_logprobs_are_unchanged_with_one_copy(kernels, tiny_checkpoints, monkeypatch,  # noqa: F811
                                                                 dtype):
    if not small_batch_kernel_fits(getattr(torch, dtype)):
        pytest.skip(f"this CPU does not run the small-batch kernel for {dtype}")
    one, one_bytes, served = _generate(tiny_checkpoints["qwen2"], dtype)  # qwen2: tie_word_embeddings
    monkeypatch.setattr(CpuPackedLinearKernel, "row_reader", lambda *args: None)  # today's two copies
    two, two_bytes, two_served = _generate(tiny_checkpoints["qwen2"], dtype)
    assert served and not two_served
    assert one == two  # tokens and logprobs, exactly
    config = json.loads((tiny_checkpoints["qwen2"] / "config.json").read_text())
    itemsize = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    assert two_bytes - one_bytes == config["vocab_size"] * config["hidden_size"] * itemsize


def test_the_plan_counts_the_tied_copy_only_where_the_embedding_keeps_one(monkeypatch):
    avx512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
    monkeypatch.setattr("tengyun.platforms.cpu.platform.cpu_flags", lambda: avx512)
    assert not CpuPlatform.tied_head_copy("float32", 1) and not CpuPlatform.tied_head_copy("bfloat16", 1)
    assert CpuPlatform.tied_head_copy("bfloat16", 2)  # vocab shards: each embedding shard keeps its rows
    assert CpuPlatform.tied_head_copy("float16", 1)
    monkeypatch.setattr("tengyun.platforms.cpu.platform.cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert CpuPlatform.tied_head_copy("float32", 1)
    # no oneDNN bfloat16 packing on AVX2: the bfloat16-weight kernel's packed copy serves the lookups
    assert not CpuPlatform.tied_head_copy("bfloat16", 1) and CpuPlatform.tied_head_copy("bfloat16", 2)
