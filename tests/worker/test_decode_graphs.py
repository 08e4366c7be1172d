"""Decode graphs (worker/decode_graphs.py) without a GPU: the CPU platform stands in for CUDA's
capture with a function that re-runs the recorded forward over the same static buffers. Only
the recording differs from a CUDA graph; batching, padding rows, the pad KV block and state
slot, and the static context length all run for real and must give the eager tokens."""

from __future__ import annotations

import logging

import pytest

from tengyun import LLM, SamplingParams
from tengyun.layers.attention.torch_sdpa import TorchSDPABackend
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.worker.decode_graphs import capture_sizes

ARGS = dict(block_size=8, max_model_len=96, kv_cache_memory="2MiB", max_num_seqs=6, max_num_batched_tokens=40)


def _prompts() -> list[list[int]]:
    """5 prompts of different lengths: prefills end on different steps, so decode batches of
    1..5 sequences occur, most of them padded to a captured size."""
    return [[(7 * i + j) % 290 + 1 for j in range(n)] for i, n in enumerate((3, 11, 26, 5, 40))]


@pytest.fixture
def cpu_graphs(monkeypatch):
    recorded = []  # per capture: (its output, whether it was the first)

    def capture(forward, first):
        recorded.append((forward(), first))  # record once, as a CUDA capture runs the forward once
        return forward  # replay: the same forward over the same static buffers

    monkeypatch.setattr(CpuPlatform, "supports_graphs", True)
    monkeypatch.setattr(CpuPlatform, "capture_graph", lambda self, forward, state=(), first=True:
                        capture(forward, first))
    monkeypatch.setattr(CpuPlatform, "graph_batch_limit", lambda self, kernels: 512)  # the stand-in records any size
    monkeypatch.setattr(TorchSDPABackend, "supports_decode_graphs", True)
    return recorded


def test_capture_sizes_follow_vllm_and_end_at_the_limit():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "qwen3_moe"])  # MoE: grouped experts, no host reads
def test_graph_replay_gives_the_eager_tokens(tiny_checkpoints, tiny_hybrid_checkpoints, cpu_graphs, monkeypatch, arch):
    folder = str({**tiny_checkpoints, **tiny_hybrid_checkpoints}[arch])
    # Sequences finish at different steps too, so decode batches shrink 5 -> 1.
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (6, 9, 12, 15, 18)]
    graphs_llm = LLM(folder, **ARGS)
    worker = graphs_llm.llm_engine.executor
    graphs = worker.runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 6] and len(cpu_graphs) == 4
    # Captured largest first; only that one is told it is the first (the CPU trace warms up for it alone).
    assert [first for _, first in cpu_graphs] == [True, False, False, False]
    got = graphs_llm.generate(_prompts(), params)

    eager = LLM(folder, **ARGS, enforce_eager=True)
    assert eager.llm_engine.executor.runner.decode_graphs is None
    want = eager.generate(_prompts(), params)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for got_top, want_top in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            for token, entry in want_top.items():
                assert got_top[token].logprob == pytest.approx(entry.logprob, abs=1e-5)
    padded = {size: n for size, n in graphs.steps.items() if n}
    assert padded.get(4) and padded.get(6), padded  # batches of 3 and 5 ran, padded by one row
    # One extra block / slot for padding, never handed to the scheduler.
    assert worker.num_blocks == eager.llm_engine.executor.num_blocks
    assert worker.kv_cache.shape[2] == worker.num_blocks + 1
    assert graphs.pad_block == worker.num_blocks
    assert graphs_llm.llm_engine.get_stats().kv_cache_usage == 0.0
    if arch == "qwen3_5":
        assert graphs.pad_slot == worker.num_state_slots
        # Rows: slots, the padding slot, then the prefix cache's snapshot rows.
        assert worker.state_cache[0].shape[0] == worker.num_state_slots + 1 + worker.num_state_snapshots
        assert worker.runner.snapshot_rows.snapshot_base == worker.num_state_slots + 1


def test_moe_experts_that_read_counts_on_the_host_run_eager_with_one_log_line(tiny_checkpoints, cpu_graphs,
                                                                              monkeypatch, caplog):
    from tengyun.layers.moe.grouped import LoopMoe

    monkeypatch.setattr(CpuPlatform, "moe_kernel", lambda self, dtype: LoopMoe())  # as quantised experts do
    with caplog.at_level(logging.INFO, logger="tengyun.worker.worker"):
        llm = LLM(str(tiny_checkpoints["qwen3_moe"]), **ARGS)
    assert llm.llm_engine.executor.runner.decode_graphs is None
    assert "Decode graphs off: MoE routing" in caplog.text


def test_backends_that_gather_the_context_run_eager(tiny_checkpoints, cpu_graphs, monkeypatch, caplog):
    monkeypatch.setattr(CpuPlatform, "attention_backend", lambda self, *args: "torch_sdpa")  # not cpu_paged
    monkeypatch.setattr(TorchSDPABackend, "supports_decode_graphs", False)
    with caplog.at_level(logging.INFO, logger="tengyun.worker.worker"):
        llm = LLM(str(tiny_checkpoints["llama"]), **ARGS)
    assert llm.llm_engine.executor.runner.decode_graphs is None
    assert "Decode graphs off: the torch_sdpa attention backend" in caplog.text
