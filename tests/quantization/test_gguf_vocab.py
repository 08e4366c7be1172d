"""A GGUF's embedding and LM head kept quantised (token_embd / output as blocks, as vLLM's GGUF
loader keeps them): lookups dequantize exactly the blocks' rows, from the blocks or from the
compiled kernel's copy a tied head holds (one copy); the head multiplies through the platform's
kernel where that kernel streams the blocks, else turns dense once at bind; tokens and logprobs
against HF's on the dequantized fp32 twin; the loaded bytes; `tengyun plan` counts them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed")
from test_gguf import _random_blocks  # noqa: E402
from test_gguf_models import VOCAB_TYPES, kept_models  # noqa: E402,F401 (fixture)
from test_quantized_models import MAX_TOKENS, _hf_greedy, _prompts, planned_and_held_bytes  # noqa: E402

from tengyun import LLM, SamplingParams  # noqa: E402
from tengyun.layers.embed_head import ParallelLMHead, VocabParallelEmbedding  # noqa: E402
from tengyun.layers.gguf_kernels import GgufReferenceKernel, dequantize_blocks  # noqa: E402
from tengyun.platforms.cpu.kernels.gguf import CpuGgufCompiledKernel  # noqa: E402
from tengyun.platforms.cpu.kernels.quant_layout import layout_bytes, quant_gemv_fits  # noqa: E402
from tengyun.quantization.gguf import GGML_TYPES, SUPPORTED_TYPES, scheme_for_type  # noqa: E402
from tengyun.worker.worker import weight_bytes  # noqa: E402

COMPILED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")  # what CpuGgufCompiledKernel holds


def _blocks(type_name: str, rows: int, seed: int = 0) -> torch.Tensor:
    blocks = 1 if GGML_TYPES[type_name].block == 256 else 3
    raw = _random_blocks(type_name, rows, blocks, seed)
    return torch.from_numpy(raw).reshape(rows, blocks, GGML_TYPES[type_name].block_bytes)


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_from_the_blocks_are_the_blocks_dequantized(type_name, dtype):
    qweight = _blocks(type_name, rows=70)
    read = GgufReferenceKernel(scheme_for_type(type_name)).row_reader({"qweight": qweight}, dtype)
    ids = torch.tensor([69, 0, 31, 32, 5, 5])
    assert torch.equal(read(ids), F.embedding(ids, dequantize_blocks(qweight, type_name, dtype)))


@pytest.mark.skipif(not quant_gemv_fits(), reason="the compiled quant kernel does not run on this CPU")
@pytest.mark.parametrize("type_name", COMPILED_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_from_the_compiled_layout_are_the_blocks_dequantized(type_name, dtype):
    """Every row of a 70-row weight (two whole blocks of 32 columns and a padded one; columns in
    both nibble halves of the 4-bit layout) reads back as the blocks' values rounded once."""
    qweight = _blocks(type_name, rows=70, seed=1)
    kernel = CpuGgufCompiledKernel(scheme_for_type(type_name))
    read = kernel.row_reader(kernel.prepare({"qweight": qweight}), dtype)
    ids = torch.arange(70).flip(0)
    assert torch.equal(read(ids), dequantize_blocks(qweight[ids], type_name, dtype))


def _pair(type_name: str, vocab: int, tied: bool, dtype: torch.dtype):
    """An embedding and a head holding ``type_name`` blocks, as apply_quant_config leaves them."""
    hidden = 32 * _blocks(type_name, 1).shape[1] * GGML_TYPES[type_name].block // 32
    embed, head = VocabParallelEmbedding(vocab, hidden, dtype), ParallelLMHead(vocab, hidden, dtype)
    if tied:  # at construction, as the models do
        head.tie_to(embed)
    scheme = scheme_for_type(type_name)
    embed.use_quant_scheme(scheme, "model.embed_tokens")
    head.use_quant_scheme(scheme, "lm_head")
    qweight = _blocks(type_name, vocab, seed=2)
    embed.qweight.weight_loader(embed.qweight, qweight)
    if not tied:
        head.qweight.weight_loader(head.qweight, _blocks(type_name, vocab, seed=3))
    return torch.nn.ModuleDict({"embed": embed, "head": head}), qweight


@pytest.mark.skipif(not quant_gemv_fits(), reason="the compiled quant kernel does not run on this CPU")
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0"])
def test_a_tied_head_holds_the_blocks_once_in_the_kernel_and_the_embedding_reads_them_there(type_name):
    from tengyun.layers.kernels import bind_kernels
    from tengyun.platforms.cpu.platform import CpuPlatform

    vocab = 197
    pair, qweight = _pair(type_name, vocab, tied=True, dtype=torch.bfloat16)
    dense = dequantize_blocks(qweight, type_name, torch.float32)
    ids = torch.tensor([196, 0, 40, 41, 7])
    before = pair.embed(ids)
    bind_kernels(pair, CpuPlatform().kernels(torch.bfloat16, 16, "bfloat16", quant_schemes=[pair.head.scheme]))
    assert isinstance(pair.head.kernel, CpuGgufCompiledKernel)
    assert pair.embed.qweight.numel() == 0 and pair.head.qweight.numel() == 0  # freed: the kernel's copy only
    assert weight_bytes(pair) == sum(t.untyped_storage().nbytes() for t in pair.head.kernel_weight.values())
    assert torch.equal(pair.embed(ids), before)
    assert torch.equal(before, dense[ids].bfloat16())
    x = torch.randn(3, dense.shape[1]).bfloat16()
    logits = pair.head.compute_logits(x)
    torch.testing.assert_close(logits.float(), x.float() @ dense.t(), rtol=1e-2, atol=1e-2)  # bf16 output


def test_without_a_streaming_kernel_the_head_turns_dense_once_and_a_tied_embedding_shares_it():
    from tengyun.layers.kernels import bind_kernels
    from tengyun.platforms.cpu.platform import CpuPlatform

    pair, qweight = _pair("Q8_0", 197, tied=True, dtype=torch.float32)  # float32: the reference kernel only
    bind_kernels(pair, CpuPlatform().kernels(torch.float32, 16, "float32", quant_schemes=[pair.head.scheme]))
    assert pair.head.scheme is None and pair.embed.scheme is None and not hasattr(pair.embed, "qweight")
    assert pair.embed.weight is pair.head.weight or pair.embed.row_reader is not None  # one dense weight
    dense = dequantize_blocks(qweight, "Q8_0", torch.float32)
    ids = torch.tensor([196, 3, 3])
    assert torch.equal(pair.embed(ids), dense[ids])
    x = torch.randn(2, dense.shape[1])
    torch.testing.assert_close(pair.head.compute_logits(x), x @ dense.t())


def _engine(folder, dtype: str, **engine):
    llm = LLM(str(folder), dtype=dtype, kv_cache_memory="8MiB", max_model_len=128, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    try:
        outs = [o.outputs[0] for o in llm.generate(_prompts(), params)]
        model, graphs = llm.llm_engine.executor.model, llm.llm_engine.executor.runner.decode_graphs
        return outs, model, weight_bytes(model), graphs
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # llama: its own head; qwen2: tied
def test_kept_vocab_layers_in_float32_give_hf_tokens_on_the_twin(kept_models, arch):  # noqa: F811
    kept, twin = kept_models[arch]
    outs, model, _, _ = _engine(kept, "float32")
    assert model.model.embed_tokens.scheme is not None or arch == "qwen2"  # tied: dense with its head
    assert [o.token_ids for o in outs] == _hf_greedy(twin, _prompts())


@pytest.mark.skipif(not quant_gemv_fits(), reason="the compiled quant kernel does not run on this CPU")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # llama: its own head; qwen2: tied
def test_kept_vocab_layers_in_bfloat16_run_quantised_hold_less_and_answer_as_a_dense_head(
        kept_models, arch, monkeypatch):  # noqa: F811
    """bfloat16: the head runs the compiled kernel, the embedding reads the compiled layout and the
    decode steps replay graphs (a trace of the whole forward: rows read without view(dtype)).
    Against the same folder with the head forced dense (its kernel said not to
    stream, so it dequantizes once at bind, the embedding too where tied): the only difference is
    the head's arithmetic (the blocks' exact values with float32 sums, against weights rounded to
    bfloat16), so the same tokens (measured) and logprobs within 0.05; the weights held differ by
    exactly the dense head's bytes minus the layout's (tied: the one dense weight both shared)."""
    kept, _ = kept_models[arch]
    outs, model, quantised, graphs = _engine(kept, "bfloat16")
    head, embed = model.lm_head, model.model.embed_tokens
    assert isinstance(head.kernel, CpuGgufCompiledKernel) and head.qweight.numel() == 0
    # the embedding reads its rows from a compiled layout (its own, or the tied head's): one copy
    assert embed.scheme is not None and embed.qweight.numel() == 0
    assert (embed.kernel_weight is None) == (arch == "qwen2")
    assert graphs is not None and any(graphs.steps.values()), "the decode steps replayed no graph"
    monkeypatch.setattr(CpuGgufCompiledKernel, "streams_quantised", False)
    dense_outs, dense_model, dense, _ = _engine(kept, "bfloat16")
    assert dense_model.lm_head.scheme is None and (dense_model.model.embed_tokens.scheme is None) == (arch == "qwen2")
    for out, expected in zip(outs, dense_outs):
        assert out.token_ids == expected.token_ids
        for token, entry, other in zip(out.token_ids, out.logprobs, expected.logprobs):
            assert abs(entry[token].logprob - other[token].logprob) < 0.05
    vocab, hidden = head.vocab_size, head.hidden_size
    type_name = VOCAB_TYPES["model.embed_tokens.weight" if arch == "qwen2" else "lm_head.weight"]
    layout = layout_bytes(vocab, hidden, hidden // 32, GGML_TYPES[type_name].bits, 2, False, type_name == "Q4_1")
    assert dense - quantised == vocab * hidden * 2 - layout


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_plan_counts_the_vocab_layers_as_the_engine_holds_them(kept_models, arch, dtype):  # noqa: F811
    """`tengyun plan` on the kept folders (Q4_1 embedding, Q8_0 head; qwen2 tied) counts what the
    worker holds: float32 turns the head dense, bfloat16 keeps both in the kernel's layout."""
    kept, _ = kept_models[arch]
    planned, held = planned_and_held_bytes(kept, dtype)
    assert planned == held
