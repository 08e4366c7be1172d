"""The gated delta rule against flash-linear-attention (fla), without a GPU.

fla ships pure-PyTorch references of its kernels (fla/ops/gated_delta_rule/naive.py), written
by its authors, not here: our PyTorch kernel must match them, and FlaGatedDeltaRule's argument
mapping (layout, scale, l2-norm, heads, state) is checked by giving it those references in
place of the Triton kernels. Not collected by `make test` (the name does not start with test_).

fla is not in the venv's site-packages: there, it makes transformers (5.x) run HF's Qwen3.5
through fla's Triton kernels even on CPU, and the HF-parity tests fail. `make setup` puts it
in .venv/fla-site, and tests/layers/test_fla_reference.py runs this file in a subprocess with
that folder on PYTHONPATH; by hand:
    PYTHONPATH=.venv/fla-site OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/layers/fla_reference_checks.py
"""

from __future__ import annotations

import inspect
import sys

import pytest
import torch
import torch.nn.functional as F

from tengyun import LLM, SamplingParams
from tengyun.layers.gated_delta_net import GatedDeltaNet
from tengyun.layers.gated_delta_rule import TorchGatedDeltaRule
from tengyun.layers.gated_delta_rule_fla import FlaGatedDeltaRule
from tengyun.layers.kernels import bind_kernels
from tengyun.platforms.cuda import platform as cuda
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.platforms.cuda.platform import CudaPlatform
from tengyun.model_spec import ModelSpec

HK, HV, DK, DV = 2, 4, 16, 8  # two value heads per key head


def _inputs(length: int, seed: int, dtype=torch.float32):
    """One sequence: q, k [L, Hk, Dk], v [L, Hv, Dv], g (log decay <= 0), beta in (0, 1) [L, Hv]."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(length, HK, DK, generator=gen), torch.randn(length, HK, DK, generator=gen)
    v = torch.randn(length, HV, DV, generator=gen)
    g = F.logsigmoid(torch.randn(length, HV, generator=gen) + 2)
    beta = torch.rand(length, HV, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype)


def _reference(q, k, v, g, beta, state):
    """fla's token-by-token reference over one sequence; it takes q/k already normalised and
    with a head each per value head: [1, L, Hv, D] inputs, [1, Hv, Dk, Dv] state."""
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    q, k = (F.normalize(x.float().repeat_interleave(HV // HK, dim=1), dim=-1) for x in (q, k))
    out, final = naive_recurrent_gated_delta_rule(q[None], k[None], v.float()[None], beta.float()[None], g[None],
                                                  initial_state=state[None], output_final_state=True)
    return out[0], final[0]


def test_torch_kernel_matches_fla_reference_across_chunks_and_decodes():
    """A prompt in two prefill chunks (70 tokens: two 64-token chunks; then 40), then three
    decode steps batched with two other sequences, each carrying its state in and out, equals
    fla's recurrence over the whole sequence from the same initial state."""
    pytest.importorskip("fla.ops.gated_delta_rule.naive")
    kernel = TorchGatedDeltaRule()
    q, k, v, g, beta = _inputs(113, seed=0)
    state0 = 0.5 * torch.randn(HV, DK, DV, generator=torch.Generator().manual_seed(1))
    expected, expected_state = _reference(q, k, v, g, beta, state0)

    out_a, state = kernel.chunk(q[:70], k[:70], v[:70], g[:70], beta[:70], state0)
    out_b, state = kernel.chunk(q[70:110], k[70:110], v[70:110], g[70:110], beta[70:110], state)
    outs = [out_a, out_b]
    others = [_inputs(3, seed=s) for s in (2, 3)]  # two more sequences decoding alongside
    other_states = torch.zeros(2, HV, DK, DV)
    for t in range(110, 113):
        batch = [torch.stack([x[t]] + [o[i][t - 110] for o in others]) for i, x in enumerate((q, k, v, g, beta))]
        out, states = kernel.recurrent(*batch, torch.cat([state[None], other_states]))
        state, other_states = states[0], states[1:]
        outs.append(out[:1])
    torch.testing.assert_close(torch.cat(outs), expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(state, expected_state, atol=2e-6, rtol=1e-5)


def test_torch_chunk_matches_fla_chunked_reference_on_a_short_prompt():
    """Fewer tokens than one chunk (zero-padded inside both) and fla's chunked form."""
    naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    q, k, v, g, beta = _inputs(5, seed=4)
    state0 = torch.randn(HV, DK, DV, generator=torch.Generator().manual_seed(5))
    out, state = TorchGatedDeltaRule().chunk(q, k, v, g, beta, state0)
    qn, kn = (F.normalize(x.repeat_interleave(HV // HK, dim=1), dim=-1)[None] for x in (q, k))
    expected, expected_state = naive.naive_chunk_gated_delta_rule(qn, kn, v[None], g[None], beta[None],
                                                                  initial_state=state0[None], output_final_state=True)
    torch.testing.assert_close(out, expected[0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(state, expected_state[0], atol=2e-6, rtol=1e-5)


def _reference_callees():
    """fla's naive functions standing in for chunk_gated_delta_rule / fused_recurrent_gated_delta_rule.
    Each call must bind to the real kernel's signature (names and order as installed); the one
    option the references lack, use_qk_l2norm_in_kernel, is applied as fla's kernels compute it
    (x / sqrt(sum(x^2) + 1e-6), fla/modules/norm/l2norm.py)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule

    calls = []

    def stand_in(real, reference):
        def call(*args, **kwargs):
            bound = inspect.signature(real).bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            calls.append((real.__name__, {name: a[name] for name in kwargs}))
            q, k = a["q"], a["k"]
            # [B, T, H, D], one q/k head per value head
            assert q.dim() == 4 and q.shape[:3] == k.shape[:3] == a["v"].shape[:3]
            if a["use_qk_l2norm_in_kernel"]:
                q, k = (x * torch.rsqrt((x.float() ** 2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
            return reference(q, k, a["v"], g=a["g"], beta=a["beta"], scale=a["scale"],
                             initial_state=a["initial_state"], output_final_state=a["output_final_state"])

        return call

    chunk = stand_in(chunk_gated_delta_rule, naive_chunk_gated_delta_rule)
    recurrent = stand_in(fused_recurrent_gated_delta_rule, naive_recurrent_gated_delta_rule)
    kernel = FlaGatedDeltaRule(chunk_fn=chunk, recurrent_fn=recurrent)
    return kernel, calls


def test_fla_kernel_maps_our_arguments_onto_fla():
    """FlaGatedDeltaRule with fla's references as callees equals our PyTorch kernel: prefill
    (key heads repeated over value heads, [1, L, H, D], scale Dk^-0.5, l2-norm in kernel,
    [1, Hv, Dk, Dv] float32 state in and out) and a batch of decodes ([B, 1, H, D])."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    fla_kernel, calls = _reference_callees()
    torch_kernel = TorchGatedDeltaRule()
    q, k, v, g, beta = _inputs(100, seed=6)
    state0 = torch.randn(HV, DK, DV, generator=torch.Generator().manual_seed(7))
    for got, want in zip(fla_kernel.chunk(q, k, v, g, beta, state0), torch_kernel.chunk(q, k, v, g, beta, state0)):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    decodes = [x[:3] for x in _inputs(3, seed=8)]  # three sequences, one token each
    states = torch.randn(3, HV, DK, DV, generator=torch.Generator().manual_seed(9))
    for got, want in zip(fla_kernel.recurrent(*decodes, states), torch_kernel.recurrent(*decodes, states)):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert [name for name, _ in calls] == ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
    assert all(kw["use_qk_l2norm_in_kernel"] and kw["output_final_state"] and kw["scale"] == DK ** -0.5
               and kw["initial_state"].dtype == torch.float32 for _, kw in calls)


def test_fla_kernel_keeps_the_models_dtype_and_a_float32_state():
    pytest.importorskip("fla.ops.gated_delta_rule")
    fla_kernel, _ = _reference_callees()
    q, k, v, g, beta = _inputs(9, seed=10, dtype=torch.bfloat16)
    out, state = fla_kernel.chunk(q, k, v, g, beta, torch.zeros(HV, DK, DV))
    assert (out.dtype, out.shape) == (torch.bfloat16, (9, HV, DV))
    assert (state.dtype, state.shape) == (torch.float32, (HV, DK, DV))
    out, state = fla_kernel.recurrent(q[:2], k[:2], v[:2], g[:2], beta[:2], torch.zeros(2, HV, DK, DV))
    assert (out.dtype, out.shape) == (torch.bfloat16, (2, HV, DV))
    assert (state.dtype, state.shape) == (torch.float32, (2, HV, DK, DV))


def test_qwen3_5_generates_the_same_tokens_through_the_fla_mapping(tiny_hybrid_checkpoints, monkeypatch):
    """The whole engine (chunked prefill over steps, decodes batched with prefills) with every
    Gated DeltaNet layer on FlaGatedDeltaRule (fla's references as callees)."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    folder = str(tiny_hybrid_checkpoints["qwen3_5"])
    prompts = [[5, 6, 7], list(range(1, 80)), list(range(1, 40)) + [9, 9]]  # 79 tokens: chunked over 4 steps
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    args = dict(dtype="float32", block_size=8, max_model_len=128, kv_cache_memory="1MiB", max_num_batched_tokens=24)
    reference = [o.outputs[0].token_ids for o in LLM(folder, **args).generate(prompts, params)]

    monkeypatch.setattr(CpuPlatform, "gated_delta_rule_kernel", lambda self: _reference_callees()[0])
    llm = LLM(folder, **args)
    layers = [m for m in llm.llm_engine.executor.model.modules() if isinstance(m, GatedDeltaNet)]
    assert layers and all(isinstance(m.kernel, FlaGatedDeltaRule) for m in layers)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference


def test_cuda_kernels_bind_fla_only_for_gated_deltanet_models(caplog):
    """A layer built on any device runs the PyTorch kernel until bound; CUDA's bundle carries fla
    when the model has linear attention, and without it neither imports fla nor logs about it."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    cfg = ModelSpec.from_hf_config(dict(
        hidden_size=32, linear_num_key_heads=HK, linear_num_value_heads=HV, linear_key_head_dim=DK,
        linear_value_head_dim=DV, rms_norm_eps=1e-6, num_attention_heads=2, num_hidden_layers=1, vocab_size=64))
    with torch.device("meta"):
        layer = GatedDeltaNet(cfg, torch.bfloat16)
    assert isinstance(layer.kernel, TorchGatedDeltaRule)
    cuda._fla_import_error.cache_clear()
    try:
        with caplog.at_level("INFO", logger="tengyun.platforms.cuda.platform"):
            assert CudaPlatform().kernels(torch.bfloat16, 256, "bfloat16").gated_delta_rule is None
            assert not [r for r in caplog.records if r.getMessage().startswith("Gated delta rule")]
            bind_kernels(layer, CudaPlatform().kernels(torch.bfloat16, 256, "bfloat16", linear_attention=True))
        assert isinstance(layer.kernel, FlaGatedDeltaRule)
    finally:
        cuda._fla_import_error.cache_clear()


def test_cuda_picks_fla_only_when_it_imports(monkeypatch, caplog):
    """CudaPlatform's choice needs no GPU: fla imports on CPU (its Triton kernels never run here)."""
    cuda._fla_import_error.cache_clear()
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)  # `import` now raises ImportError
    with caplog.at_level("INFO", logger="tengyun.platforms.cuda.platform"):
        assert isinstance(CudaPlatform().gated_delta_rule_kernel(), TorchGatedDeltaRule)
        CudaPlatform().gated_delta_rule_kernel()
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["Gated delta rule: PyTorch kernel"]  # once
    monkeypatch.undo()
    cuda._fla_import_error.cache_clear()
    pytest.importorskip("fla.ops.gated_delta_rule")
    try:
        assert isinstance(CudaPlatform().gated_delta_rule_kernel(), FlaGatedDeltaRule)
    finally:
        cuda._fla_import_error.cache_clear()
