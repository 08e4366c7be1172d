"""The compiled fused layer ops (tengyun/csrc/layer_ops.cpp, platforms/cpu/kernels/layer_ops.py) against
PyTorch's (TorchLayerOps, HF's arithmetic): RMSNorm with and without the residual add, with a
gamma in the model dtype (Llama) and in float32 (Qwen3.5's 1 + w), neox rotary on strided q/k
views of one qkv tensor (odd head counts, GQA, partial rotary), SiLU-and-mul, and W8A8's
per-token int8 quantisation and int32 rescale (bit-equal to quant_kernels.py's PyTorch ops);
float32, bfloat16 and float16, on every instruction-set copy this CPU runs. 16-bit results may differ from
PyTorch's by a rounding step where float32 sums were added in another order, two where that
step is rounded again by the product with a 16-bit gamma."""

from __future__ import annotations

import pytest
import torch

from tengyun.layers.layer_ops import TORCH_LAYER_OPS
from tengyun.layers.quant_kernels import quantize_per_token
from tengyun.layers.rotary_embedding import RotaryEmbedding
from tengyun.platforms.cpu.kernels.layer_ops import CpuFusedLayerOps
from tengyun.platforms.cpu.kernels.quant import CpuW8A8Kernel

from test_cpu_paged_attention import ISAS, kernels  # noqa: F401 - the build-or-skip fixture

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TWO_STEPS = {torch.float32: 2e-6, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}  # relative


@pytest.fixture(params=ISAS)
def fused(request, kernels):  # noqa: F811
    """CpuFusedLayerOps on each instruction-set copy this CPU has; the best one again afterwards."""
    best = kernels.isa()
    try:
        torch.ops.tengyun.paged_attention_isa(request.param)
    except RuntimeError:
        pytest.skip(f"this CPU lacks {request.param}")
    yield CpuFusedLayerOps()
    torch.ops.tengyun.paged_attention_isa(best)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), rtol=TWO_STEPS[actual.dtype], atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (37, 896), (5, 17), (130, 64)])
@pytest.mark.parametrize("wide_gamma", [False, True])
def test_rms_norm_and_residual_add_match_pytorch(fused, dtype, rows, hidden, wide_gamma):
    gen = torch.Generator().manual_seed(rows * hidden)
    # x: every other row of a wider tensor (strided rows, as a slice of a projection's output)
    x = torch.randn(rows, 2, hidden, generator=gen).to(dtype)[:, 0]
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) - 0.5).to(dtype)
    gamma_fused = fused.norm_weight(weight, 1.0 if wide_gamma else 0.0)
    gamma_torch = TORCH_LAYER_OPS.norm_weight(weight, 1.0 if wide_gamma else 0.0)
    assert gamma_fused.dtype == (torch.float32 if wide_gamma else dtype)
    _close(fused.rms_norm(x, gamma_fused, 1e-6), TORCH_LAYER_OPS.rms_norm(x, gamma_torch, 1e-6))
    out, added = fused.add_rms_norm(x, residual, gamma_fused, 1e-5)
    ref_out, ref_added = TORCH_LAYER_OPS.add_rms_norm(x, residual, gamma_torch, 1e-5)
    assert torch.equal(added, ref_added)  # one rounding, the same in both
    _close(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(9, 3, 64, 64), (7, 1, 32, 32), (4, 2, 256, 64),
                                                                 (3, 3, 18, 18)])
def test_rotary_matches_pytorch_on_views_of_one_qkv_tensor(fused, dtype, heads, kv_heads, head_dim, rotary_dim):
    tokens, gen = 11, torch.Generator().manual_seed(heads * head_dim)
    rope = RotaryEmbedding(head_dim, rotary_dim, 4096, dict(rope_type="default", rope_theta=1e6))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    q, k = qkv[:, : heads * head_dim], qkv[:, heads * head_dim: (heads + kv_heads) * head_dim]
    expected_q, expected_k = rope(positions, q.clone(), k.clone())  # PyTorch until bound
    rope.ops = fused
    got_q, got_k = rope(positions, q, k)
    _close(got_q, expected_q)
    _close(got_k, expected_k)
    v = qkv[:, (heads + kv_heads) * head_dim:]
    assert torch.equal(v, qkv[:, (heads + kv_heads) * head_dim:])  # v untouched by the in-place turn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,rotary_dim", [(1, 9, 3, 64), (13, 5, 1, 18)])
def test_rotary_at_positions_turns_as_the_gathered_rows_do(fused, dtype, tokens, heads, kv_heads, rotary_dim):
    gen = torch.Generator().manual_seed(tokens * heads)
    table = torch.randn(2, 300, rotary_dim // 2, generator=gen)  # cos, sin rows: any float32 values
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    q = torch.randn(tokens, heads, rotary_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, rotary_dim, generator=gen).to(dtype)
    want_q, want_k = TORCH_LAYER_OPS.rotary(q.clone(), k.clone(), table[0][positions].unsqueeze(1),
                                            table[1][positions].unsqueeze(1))
    got_q, got_k = fused.rotary_at(q, k, table[0], table[1], positions)
    _close(got_q, want_q)
    _close(got_k, want_k)
    with pytest.raises(RuntimeError, match="position 300 is outside the 300-row tables"):
        fused.rotary_at(q, k, table[0], table[1], torch.full((tokens,), 300))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,block_size", [(1, 9, 3, 64, 16), (5, 7, 7, 32, 128),
                                                                        (3, 14, 2, 64, 16), (2, 5, 1, 18, 128)])
def test_decode_qkv_to_cache_matches_rotary_then_cache_write(fused, dtype, tokens, heads, kv_heads, head_dim,
                                                             block_size):
    gen = torch.Generator().manual_seed(tokens * heads * head_dim)
    rope = RotaryEmbedding(head_dim, head_dim, 1000, dict(rope_type="default", rope_theta=1e4))
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width + 5, generator=gen).to(dtype)[:, :width]  # strided rows
    positions = torch.randint(0, 1000, (tokens,), generator=gen)
    caches = torch.randn(2, 6, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(6 * block_size, generator=gen)[:tokens]
    # the reference: PyTorch's rotary on q, k, then the cache write (AttentionBackend.write_kv)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q, want_k = rope(positions, q.clone(), k.clone())
    want = caches.clone()
    want[0].view(-1, kv_heads, head_dim)[slots] = want_k.view(tokens, kv_heads, head_dim)
    want[1].view(-1, kv_heads, head_dim)[slots] = v.reshape(tokens, kv_heads, head_dim)
    got = caches.clone()
    before = qkv.clone()
    got_q = torch.ops.tengyun.decode_qkv_to_cache(qkv, rope.cos, rope.sin, positions, got[0], got[1], slots,
                                                  heads, kv_heads)
    assert got_q.is_contiguous() and got_q.shape == (tokens, heads, head_dim)
    _close(got_q, want_q.view(tokens, heads, head_dim))
    _close(got, want)
    assert torch.equal(qkv, before)  # the projection's output is only read
    with pytest.raises(RuntimeError, match="is outside the cache's"):
        torch.ops.tengyun.decode_qkv_to_cache(qkv, rope.cos, rope.sin, positions, got[0], got[1],
                                              torch.full((tokens,), 6 * block_size), heads, kv_heads)
    with pytest.raises(RuntimeError, match="qkv and the caches must have one dtype"):
        torch.ops.tengyun.decode_qkv_to_cache(qkv.double().float() if dtype != torch.float32 else qkv.bfloat16(),
                                              rope.cos, rope.sin, positions, got[0], got[1], slots, heads, kv_heads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,block_size", [(1, 9, 3, 64, 16), (128, 9, 3, 64, 16),
                                                                        (37, 14, 2, 64, 128), (6, 5, 1, 18, 16)])
def test_qkv_to_cache_turns_q_k_in_place_and_writes_the_cache(fused, dtype, tokens, heads, kv_heads, head_dim,
                                                              block_size):
    """A prefill's rotary_neox_at_ and its two cache writes (AttentionBackend.write_kv) in one op."""
    gen = torch.Generator().manual_seed(tokens * heads * head_dim + 1)
    rope = RotaryEmbedding(head_dim, head_dim, 1000, dict(rope_type="default", rope_theta=1e4))
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width + 5, generator=gen).to(dtype)[:, :width]  # strided rows
    positions = torch.randint(0, 1000, (tokens,), generator=gen)
    num_blocks = -(-tokens // block_size) + 2
    caches = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    want_qkv = qkv.clone()
    q, k, v = want_qkv.split(sizes, dim=-1)
    fused.rotary_at(q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), rope.cos, rope.sin,
                    positions)
    want = caches.clone()
    want[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, k.reshape(tokens, kv_heads, head_dim))
    want[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, v.reshape(tokens, kv_heads, head_dim))
    got = caches.clone()
    torch.ops.tengyun.qkv_to_cache_(qkv, rope.cos, rope.sin, positions, got[0], got[1], slots, heads, kv_heads)
    assert torch.equal(qkv, want_qkv)  # the same kernel turns q and k: the same bits
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="qkv_to_cache_: position 1000 is outside the 1000-row tables"):
        torch.ops.tengyun.qkv_to_cache_(qkv, rope.cos, rope.sin, torch.full((tokens,), 1000), got[0], got[1],
                                        slots, heads, kv_heads)
    assert torch.equal(qkv, want_qkv) and torch.equal(got, want)  # checked before anything is written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3072), (19, 2 * 4864), (2, 3, 34)])
def test_silu_and_mul_matches_pytorch(fused, dtype, shape):
    x = (3 * torch.randn(*shape, generator=torch.Generator().manual_seed(shape[-1]))).to(dtype)
    x[..., 0] = -100.0  # exp's clamped range: silu(-100) is -0.0 in both
    _close(fused.silu_and_mul(x), TORCH_LAYER_OPS.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (33, 1537), (4, 7), (130, 64)])
def test_w8a8_quantize_and_rescale_are_bit_equal_to_pytorch(fused, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (3 * torch.randn(rows, 2, hidden, generator=gen)).to(dtype)[:, 0]  # strided rows
    x[0] = 0.0  # a row of zeros: the scale's 1e-10 floor
    x[-1, :4] = torch.tensor([0.5, 1.5, -2.5, 0.0]).to(dtype)
    x[-1, 4:] = x[-1, 4:].clamp(-127.0, 127.0)
    x[-1, 4] = 127.0  # amax 127: scale 1, so the halves above round to even (0, 2, -2)
    x_q, s_x = torch.ops.tengyun.quantize_per_token_int8(x)
    want_q, want_s = quantize_per_token(x)
    assert x_q.dtype == torch.int8 and s_x.dtype == torch.float32 and s_x.shape == (rows, 1)
    assert torch.equal(x_q, want_q) and torch.equal(s_x, want_s)
    acc = torch.randint(-2 ** 24, 2 ** 24, (rows, hidden), dtype=torch.int32, generator=gen)
    s_w = torch.rand(hidden, 1, generator=gen).to(dtype)
    want = (acc.float() * s_x * s_w.float().t()).to(dtype)
    assert torch.equal(torch.ops.tengyun.rescale_int32(acc, s_x, s_w, dtype), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_w8a8_kernel_equals_the_pytorch_ops(fused, dtype):
    gen = torch.Generator().manual_seed(5)
    prepared = {"weight": torch.randint(-127, 128, (96, 70), dtype=torch.int8, generator=gen),
                "weight_scale": torch.rand(96, 1, generator=gen).to(dtype)}
    bias = torch.randn(96, generator=gen).to(dtype)
    for tokens in (1, 3, 32):
        x = torch.randn(tokens, 70, generator=gen).to(dtype)
        want = CpuW8A8Kernel(None).apply(x, prepared, bias)
        assert torch.equal(CpuW8A8Kernel(None, compiled=True).apply(x, prepared, bias), want)


def test_bad_arguments_name_what_to_fix(kernels):  # noqa: F811
    ops = torch.ops.tengyun
    with pytest.raises(RuntimeError, match="gamma must be a contiguous \\[H\\]"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="gamma must have x's dtype or float32"):
        ops.rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.float16), 1e-6)
    with pytest.raises(RuntimeError, match="even R"):
        ops.rotary_neox_(torch.randn(2, 3, 5), torch.randn(2, 1, 5), torch.ones(2, 2), torch.ones(2, 2))
    with pytest.raises(RuntimeError, match="x must be a CPU \\[..., 2d\\]"):
        ops.silu_and_mul(torch.randn(3, 5))
    with pytest.raises(RuntimeError, match="must be float32, bfloat16 or float16"):
        ops.silu_and_mul(torch.ones(3, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="x must be a CPU \\[M, K\\]"):
        ops.quantize_per_token_int8(torch.randn(2, 3, 4))
    with pytest.raises(RuntimeError, match="acc must be a contiguous CPU int32"):
        ops.rescale_int32(torch.ones(2, 3), torch.ones(2, 1), torch.ones(3, 1), torch.float32)
