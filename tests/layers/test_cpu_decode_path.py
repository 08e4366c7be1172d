"""Steps on CPU through the compiled kernels end to end: the qkv projection taken whole by
cpu_paged (Attention.from_qkv: at decode rotary, cache write and attention in two calls; in a
prefill rotary and both cache writes in one) and the small-batch linear kernel give the tokens
and logprobs of the op-by-op path, for Llama (GQA) and Qwen2 (qkv bias), batch 1 and several
sequences, in float32 and bfloat16; Qwen3 (q/k norms) keeps the op-by-op path."""

from __future__ import annotations

import pytest

from tengyun import LLM, SamplingParams
from tengyun.layers.attention.layer import Attention
from tengyun.layers.attention.metadata import get_attention_metadata
from tengyun.models.llama import LlamaAttention

from test_cpu_paged_attention import kernels  # noqa: F401 - the build-or-skip fixture


def _generate(folder, dtype: str, fused: bool, prompts: list[list[int]], calls: list[tuple[bool, bool]]):
    """Greedy tokens and logprobs; ``calls`` gets (step has prefills, taken whole) per from_qkv call."""
    # Eager: the patches below change Python per step, which a decode graph would not rerun.
    llm = LLM(str(folder), dtype=dtype, block_size=16, max_model_len=128, kv_cache_memory="4MiB", enforce_eager=True)
    model = llm.llm_engine.executor.model
    for module in model.modules():
        if isinstance(module, LlamaAttention):
            module.fuses_qkv = module.fuses_qkv and fused
        if isinstance(module, Attention):
            original = module.from_qkv

            def counted(*args, original=original):
                out = original(*args)
                calls.append((bool(get_attention_metadata().prefills), out is not None))
                return out

            module.from_qkv = counted
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_decode_matches_the_op_by_op_path(kernels, tiny_checkpoints, arch, dtype, batch):  # noqa: F811
    prompts = [[5 + i, 17, 33, 2 + 3 * i, 40][: 3 + i] for i in range(batch)]
    fused_calls, plain_calls = [], []
    fused = _generate(tiny_checkpoints[arch], dtype, True, prompts, fused_calls)
    plain = _generate(tiny_checkpoints[arch], dtype, False, prompts, plain_calls)
    assert {prefill for prefill, _ in fused_calls} == {True, False}  # prefills and decodes
    assert all(whole for _, whole in fused_calls)
    assert not plain_calls
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(fused, plain):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < tolerance


def test_q_k_norm_models_keep_the_op_by_op_path(kernels, tiny_checkpoints):  # noqa: F811
    calls: list[tuple[bool, bool]] = []
    _generate(tiny_checkpoints["qwen3"], "float32", True, [[5, 6, 7]], calls)
    assert not calls
