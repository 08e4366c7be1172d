"""The compiled draw (tengyun/csrc/sampling.cpp, torch.ops.tengyun.sample_rows) against the
sampler's PyTorch ops on the same uniforms: greedy rows the argmax, random rows the inverse CDF of
softmax(logits / temperature), from float32, bfloat16 and float16 logits, vocabularies that are
not a multiple of the vector width, on every instruction-set copy this CPU runs; masked tokens
never drawn; errors that name the argument; and the engine's tokens with and without it."""

from __future__ import annotations

import pytest
import torch

from tengyun import LLM, SamplingParams
from tengyun.layers.sampling.draw import sample_from_probs
from tengyun.platforms.cpu.platform import CpuPlatform

from test_cpu_paged_attention import isa, kernels  # noqa: F401 - the build-or-skip and per-ISA fixtures


@pytest.fixture
def sample_rows(isa):  # noqa: F811
    """torch.ops.tengyun.sample_rows on each instruction-set copy this CPU has."""
    return torch.ops.tengyun.sample_rows


def _pytorch_draw(logits, temperature, u):
    """The sampler's ops: float32 logits / t, softmax, float64 CDF, search (sampler.py)."""
    return sample_from_probs((logits.float() / temperature.unsqueeze(1)).softmax(dim=-1), u)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (37, 1003), (64, 4096), (5, 7)])
def test_random_rows_draw_the_tokens_pytorchs_inverse_cdf_draws(sample_rows, dtype, rows, vocab):
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.05
    u = torch.rand(rows, dtype=torch.float64, generator=gen)
    assert torch.equal(sample_rows(logits, temperature, u), _pytorch_draw(logits, temperature, u))
    ones = torch.ones(rows)
    assert torch.equal(sample_rows(logits, None, u), _pytorch_draw(logits, ones, u))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_rows_take_the_first_maximum(sample_rows, dtype):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(-3, 4, (40, 333), generator=gen).to(dtype)  # many ties
    assert torch.equal(sample_rows(logits), logits.float().argmax(dim=-1))
    u = torch.rand(40, dtype=torch.float64, generator=gen)
    temperature = torch.full((40,), 0.5)
    greedy = torch.arange(40) % 3 == 0
    want = torch.where(greedy, logits.float().argmax(dim=-1), _pytorch_draw(logits, temperature, u))
    assert torch.equal(sample_rows(logits, temperature, u, greedy), want)


def test_masked_and_negligible_tokens_are_never_drawn(sample_rows):
    logits = torch.full((4, 37), float("-inf"))
    logits[:, 1], logits[:, 33] = 0.0, 0.0  # two tokens of probability 1/2; 33 in the vector tail
    u = torch.tensor([0.0, 0.5, 0.9999999, 1.0 - 2 ** -53], dtype=torch.float64)
    assert sample_rows(logits, None, u).tolist() == [1, 33, 33, 33]
    # Token 1 sits 100 nats below the others (probability 1e-44): it weighs 0, so u = 0.5 lands
    # exactly on token 0's CDF step and moves on to token 2.
    row = torch.tensor([[0.0, -100.0, 0.0]])
    assert sample_rows(row, None, torch.tensor([0.5], dtype=torch.float64)).tolist() == [2]
    assert sample_rows(torch.full((1, 5), float("-inf"))).tolist() == [0]  # no valid token: no crash


def test_bad_arguments_name_what_to_fix(kernels):  # noqa: F811
    op = torch.ops.tengyun.sample_rows
    with pytest.raises(RuntimeError, match="logits must be a CPU \\[B, V\\]"):
        op(torch.randn(2, 3, 4))
    with pytest.raises(RuntimeError, match="logits must be float32, bfloat16 or float16"):
        op(torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="u must be a contiguous Double \\[2\\]"):
        op(torch.randn(2, 4), None, torch.rand(2))
    with pytest.raises(RuntimeError, match="temperature must be a contiguous Float \\[2\\]"):
        op(torch.randn(2, 4), torch.ones(3), torch.rand(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="greedy must be a contiguous Bool \\[2\\]"):
        op(torch.randn(2, 4), None, torch.rand(2, dtype=torch.float64), torch.ones(2))


def test_the_engine_samples_the_same_tokens_with_and_without_the_kernel(kernels, tiny_checkpoints,  # noqa: F811
                                                                        monkeypatch):
    """Seeded random rows next to a greedy one in bfloat16 (the kernel reads those logits as they
    are). A batch with a top_k / top_p / min_p row runs PyTorch's ops (test_sampler.py)."""
    folder = str(tiny_checkpoints["qwen2"])
    prompts = [[5, 6, 7], [(3 * i) % 300 + 1 for i in range(40)], list(range(1, 20))]
    params = [SamplingParams(temperature=0.8, seed=11, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.3, seed=5, max_tokens=20, ignore_eos=True)]
    args = dict(dtype="bfloat16", block_size=8, max_model_len=96, kv_cache_memory="1MiB")
    llm = LLM(folder, **args)
    assert llm.llm_engine.executor.runner.sampler.sample_rows is not None
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setattr(CpuPlatform, "sample_rows_kernel", lambda self: None)
    plain = LLM(folder, **args)
    assert plain.llm_engine.executor.runner.sampler.sample_rows is None
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
