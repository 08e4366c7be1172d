"""MoE experts as grouped matmuls (layers/moe/): the grouped path equals the per-expert loop it
replaced, reads nothing back to the host, and torch_npu's MoE ops (checked on the documented
stand-in, tests/platforms/fake_torch_npu.py) compute the same layer."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tengyun.layers.fused_moe import FusedMoE
from tengyun.layers.moe.grouped import LoopMoe, TorchGroupedMoe, loop_experts
from tengyun.layers.moe.routing import sort_by_expert

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "platforms"))
import fake_torch_npu  # noqa: E402

# Tensor methods that copy device data to the host (a synchronisation on CUDA / NPU).
HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}


class HostReads(TorchFunctionMode):
    """Counts the calls of HOST_READS made inside it."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _layer(dtype, num_experts=8, top_k=2, hidden=32, inter=16, seed=0) -> FusedMoE:
    torch.manual_seed(seed)
    layer = FusedMoE(num_experts, top_k, hidden, inter, True, dtype)
    layer.w13_weight.data.normal_(0, 0.2)
    layer.w2_weight.data.normal_(0, 0.2)
    return layer


def _inputs(dtype, tokens, num_experts=8, hidden=32, seed=1):
    torch.manual_seed(seed)
    return torch.randn(tokens, hidden, dtype=dtype), torch.randn(tokens, num_experts, dtype=dtype)


def _loop(layer: FusedMoE, x, logits, first=0, num_local=None):
    """The per-expert loop of F.linear the grouped path replaced."""
    weights, ids = layer.moe_kernel.route(logits, layer.top_k, layer.renormalize)
    num_local = num_local or layer.num_local
    stacks = {"w13": layer.w13_weight[first:first + num_local], "w2": layer.w2_weight[first:first + num_local]}
    return loop_experts(x, weights, ids, first, num_local, lambda s, e, rows: F.linear(rows, stacks[s][e]))


def test_sort_by_expert_puts_other_ranks_experts_last():
    ids = torch.tensor([[2, 0], [3, 2], [1, 0]])
    groups = sort_by_expert(ids, first=2, num_local=2)
    assert groups.order.tolist() == [0, 3, 2, 1, 4, 5]
    assert groups.tokens.tolist() == [0, 1, 1, 0, 2, 2]
    assert groups.counts.tolist() == [2, 1]
    assert groups.local.tolist() == [True, True, True, False, False, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_grouped_experts_equal_the_per_expert_loop(dtype, tokens):
    layer = _layer(dtype)
    x, logits = _inputs(dtype, tokens)
    assert isinstance(layer.moe_kernel, TorchGroupedMoe) and layer.supports_graph_capture
    torch.testing.assert_close(layer(x, logits), _loop(layer, x, logits), rtol=0, atol=0)


@pytest.mark.parametrize("first, num_local", [(0, 4), (4, 4), (2, 3)])
def test_grouped_experts_of_a_slice_of_experts_sum_only_theirs(first, num_local):
    """A rank holding experts [first, first + num_local): the other experts' rows add nothing."""
    layer = _layer(torch.float32)
    x, logits = _inputs(torch.float32, 9)
    weights, ids = layer.moe_kernel.route(logits, 2, True)
    got = TorchGroupedMoe().experts(x, weights, ids, first, layer.w13_weight[first:first + num_local],
                                    layer.w2_weight[first:first + num_local])
    torch.testing.assert_close(got, _loop(layer, x, logits, first, num_local), rtol=0, atol=0)


def test_grouped_moe_forward_reads_nothing_back_to_the_host():
    layer = _layer(torch.bfloat16)
    x, logits = _inputs(torch.bfloat16, 16)
    with HostReads() as reads:
        layer(x, logits)
    assert reads.calls == []
    layer.moe_kernel = LoopMoe()  # the loop it replaced reads the counts: the counter sees it
    with HostReads() as reads:
        layer(x, logits)
    assert "tolist" in reads.calls and not layer.supports_graph_capture


@pytest.fixture
def fake_npu(monkeypatch):
    fake = fake_torch_npu.module()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("first, num_local", [(0, 8), (4, 4)])
def test_npu_moe_ops_compute_the_pytorch_layer(fake_npu, dtype, first, num_local):
    from tengyun.platforms.npu.kernels.moe import NpuMoe

    layer = _layer(dtype)
    x, logits = _inputs(dtype, 11)
    kernel = NpuMoe()
    w13, w2 = kernel.prepare(layer.w13_weight[first:first + num_local], layer.w2_weight[first:first + num_local])
    assert w13.shape == (num_local, 32, 32) and w13.transpose(1, 2).is_contiguous()
    weights, ids = kernel.route(logits, 2, True)
    expected_weights, expected_ids = TorchGroupedMoe().route(logits, 2, True)
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_weights)
    got = kernel.experts(x, weights, ids, first, w13, w2)
    want = TorchGroupedMoe().experts(x, expected_weights, expected_ids, first, w13, w2)
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, **tolerance)
    for op in ("npu_moe_gating_top_k_softmax", "npu_moe_init_routing", "npu_moe_compute_expert_tokens",
               "npu_moe_finalize_routing"):
        assert fake_npu.calls[op] == 1
    assert fake_npu.calls["npu_grouped_matmul"] == 2


def test_npu_platform_chooses_the_npu_moe_ops_and_cpu_the_grouped_matmul(fake_npu):
    from tengyun.platforms.cpu.platform import CpuPlatform
    from tengyun.platforms.cuda.platform import CudaPlatform
    from tengyun.platforms.kernel_choice import KernelQuery
    from tengyun.platforms.npu.platform import NpuPlatform

    bf16, fp16, fp32 = KernelQuery("bfloat16"), KernelQuery("float16"), KernelQuery("float32")
    assert NpuPlatform.choose_kernel("moe", bf16).name == "npu_moe"
    assert [CpuPlatform.choose_kernel("moe", q).name for q in (bf16, fp16, fp32)] == ["torch_grouped_mm"] * 3
    assert CudaPlatform.choose_kernel("moe", bf16).name == "torch_grouped_mm"
    # a GPU's torch._grouped_mm takes bfloat16 only: other dtypes loop over the experts
    assert CudaPlatform.choose_kernel("moe", fp16).name == "torch_loop"
