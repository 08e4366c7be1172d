"""Decode graphs on CPU for real (platforms/cpu/runtime/graphs.py): TorchScript traces of the decode
forward, replayed instead of the eager forward for decode batches up to the small-batch linear's
rows (and, where oneDNN packs bfloat16 for AMX, the AMX tile kernel's). Every replayed step must
give the eager engine's tokens and logprobs. The small-batch limit is held at MAX_SMALL_ROWS on every
CPU here (where oneDNN packs for AMX the engine lowers it to 4: test_cpu_linear.py), so graphs of 8
and 16 rows are traced on such CPUs too."""

from __future__ import annotations

import logging

import pytest
import torch

from tengyun import LLM, SamplingParams
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.platforms.cpu.kernels import choice
from tengyun.platforms.cpu.kernels import linear as cpu_linear
from tengyun.platforms.cpu.kernels.bf16_weights import bf16_weight_kernel_fits
from tengyun.platforms.cpu.kernels.linear import MAX_SMALL_ROWS
from tengyun.platforms.kernel_choice import KernelQuery, choose

ARGS = dict(block_size=8, max_model_len=96, kv_cache_memory="2MiB", max_num_seqs=6, max_num_batched_tokens=40)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(autouse=True)
def _the_limit_on_any_cpu(monkeypatch):
    monkeypatch.setattr(cpu_linear, "AMX_MAX_SMALL_ROWS", max(MAX_SMALL_ROWS.values()))


def _prompts() -> list[list[int]]:
    """Prefills end on different steps and sequences finish at different steps, so decode batches
    of 1..5 sequences occur."""
    return [[(7 * i + j) % 290 + 1 for j in range(n)] for i, n in enumerate((3, 11, 26, 5, 40))]


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (6, 9, 12, 15, 18)]


def _same_outputs(got, want) -> None:
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for got_top, want_top in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            for token, entry in want_top.items():
                assert got_top[token].logprob == pytest.approx(entry.logprob, abs=1e-5)


def _needs_kernel(dtype: str) -> None:
    """The CPU's linear for dtype is a compiled op a trace holds: the small-batch kernel, or for
    bfloat16 on cores where oneDNN packs none (AVX2) the bfloat16-weight kernel."""
    chosen = choose("linear", CpuPlatform.kernel_candidates("linear"), KernelQuery(dtype)).name
    if chosen not in ("cpu_packed_small_batch", "cpu_bf16_weights"):
        pytest.skip(f"no compiled small-batch {dtype} linear on this machine: graphs are off")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_5"])
def test_traced_decode_steps_give_the_eager_tokens(tiny_checkpoints, tiny_hybrid_checkpoints, arch, dtype):
    _needs_kernel(dtype)
    folder = str({**tiny_checkpoints, **tiny_hybrid_checkpoints}[arch])
    llm = LLM(folder, dtype=dtype, **ARGS)
    graphs = llm.llm_engine.executor.runner.decode_graphs
    limit = min(ARGS["max_num_seqs"], MAX_SMALL_ROWS[DTYPES[dtype]])
    assert graphs is not None and graphs.sizes == [s for s in (1, 2, 4, 6) if s <= limit]
    got = llm.generate(_prompts(), _params())
    want = LLM(folder, dtype=dtype, enforce_eager=True, **ARGS).generate(_prompts(), _params())
    _same_outputs(got, want)
    assert all(graphs.steps[s] for s in graphs.sizes), graphs.steps  # every size replayed
    assert llm.llm_engine.get_stats().kv_cache_usage == 0.0


def test_bfloat16_traces_decode_batches_up_to_16(tiny_checkpoints):
    """The bfloat16 small-batch limit (16 rows) sets the largest graph: 16 sequences decode from
    graphs of 16, 8, 4, 2 and 1 as they finish, with the eager tokens."""
    _needs_kernel("bfloat16")
    args = {**ARGS, "max_num_seqs": 16, "kv_cache_memory": "8MiB"}
    prompts = [[(5 * i + j) % 290 + 1 for j in range(3 + i)] for i in range(16)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + i, ignore_eos=True, logprobs=3) for i in range(16)]
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="bfloat16", **args)
    graphs = llm.llm_engine.executor.runner.decode_graphs
    assert graphs.sizes == [1, 2, 4, 8, 16]
    got = llm.generate(prompts, params)
    want = LLM(str(tiny_checkpoints["llama"]), dtype="bfloat16", enforce_eager=True, **args).generate(prompts, params)
    _same_outputs(got, want)
    assert graphs.steps[16], graphs.steps  # a 9..16-sequence decode replayed the largest graph


def test_bfloat16_weight_kernel_traces_decode_steps_with_the_eager_tokens(tiny_checkpoints, monkeypatch):
    """Where oneDNN packs no bfloat16 weight (AVX2 cores; made so here on any CPU), bfloat16 linears
    run the compiled bfloat16-weight kernel, an op a trace holds: decode graphs are captured and
    replay the eager engine's tokens."""
    if not bf16_weight_kernel_fits():
        pytest.skip("this CPU does not run the AVX2 bfloat16-weight kernel")
    monkeypatch.setattr(choice, "_why_not_small_batch", lambda q: "held off by the test")
    monkeypatch.setattr(choice, "_why_not_onednn", lambda q: "held off by the test")
    folder = str(tiny_checkpoints["qwen2"])
    llm = LLM(folder, dtype="bfloat16", **ARGS)
    assert type(llm.llm_engine.executor.kernels.linear).__name__ == "CpuBf16WeightKernel"
    graphs = llm.llm_engine.executor.runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 6]
    got = llm.generate(_prompts(), _params())
    _same_outputs(got, LLM(folder, dtype="bfloat16", enforce_eager=True, **ARGS).generate(_prompts(), _params()))
    assert all(graphs.steps[s] for s in graphs.sizes), graphs.steps


def test_where_amx_tiles_run_bfloat16_traces_decode_batches_past_16(tiny_checkpoints):
    """The AMX tile kernel (cpu/kernels/linear.py) takes up to AMX_TILE_ROWS rows as a compiled op a
    trace holds, so the graph limit rises to it: 24 sequences decode from graphs of 24 and 16 as
    they finish, with the eager tokens."""
    _needs_kernel("bfloat16")
    if not cpu_linear.amx_tiles_fit():
        pytest.skip("no AMX tiles on this machine")
    args = {**ARGS, "max_num_seqs": 24, "kv_cache_memory": "8MiB", "max_num_batched_tokens": 96}
    prompts = [[(5 * i + j) % 290 + 1 for j in range(3 + i % 5)] for i in range(24)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + i, ignore_eos=True, logprobs=3) for i in range(24)]
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="bfloat16", **args)
    graphs = llm.llm_engine.executor.runner.decode_graphs
    assert graphs.sizes == [1, 2, 4, 8, 16, 24]
    got = llm.generate(prompts, params)
    want = LLM(str(tiny_checkpoints["llama"]), dtype="bfloat16", enforce_eager=True, **args).generate(prompts, params)
    _same_outputs(got, want)
    assert graphs.steps[24] and graphs.steps[16], graphs.steps


def test_a_size_that_cannot_be_traced_runs_eager(tiny_checkpoints, monkeypatch):
    """With the small-batch kernel held to 2 rows, batch 4 at float32 runs oneDNN's packed weights,
    which a trace cannot hold: sizes 1 and 2 replay, 3..5 run eager, and the tokens are the eager
    ones."""
    _needs_kernel("float32")
    monkeypatch.setitem(MAX_SMALL_ROWS, torch.float32, 2)
    monkeypatch.setattr(CpuPlatform, "graph_batch_limit", lambda self, kernels: 4)
    folder = str(tiny_checkpoints["llama"])
    llm = LLM(folder, dtype="float32", **ARGS)
    graphs = llm.llm_engine.executor.runner.decode_graphs
    assert graphs.sizes == [1, 2]
    got = llm.generate(_prompts(), _params())
    _same_outputs(got, LLM(folder, dtype="float32", enforce_eager=True, **ARGS).generate(_prompts(), _params()))


def test_graphs_stay_off_without_the_small_batch_kernel(tiny_checkpoints, monkeypatch, caplog):
    monkeypatch.setattr("tengyun.platforms.cpu.kernels.linear.small_batch_kernel_fits", lambda dtype: False)
    with caplog.at_level(logging.INFO, logger="tengyun.worker.worker"):
        llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", **ARGS)
    assert llm.llm_engine.executor.runner.decode_graphs is None
    assert "Decode graphs off: the cpu_paged attention backend with OneDNNPackedLinearKernel" in caplog.text


def test_tensor_parallel_ranks_run_eager():
    """gloo's collectives are Python calls, not ops a trace records: a traced TP step would skip
    its all-reduce. (The TP parity tests run the engine itself at TP 2.)"""
    assert "tensor parallelism" in CpuPlatform().graph_blocker(2)
    assert CpuPlatform().graph_blocker(1) is None


@pytest.mark.parametrize("scheme", ["w8a8", "w4a16"])
def test_traced_quantised_decode_steps_give_the_eager_tokens(tiny_checkpoints, tmp_path, scheme):
    """The quantised kernels (int8 GEMV / torch._int_mm, the compiled 4-bit kernel) inside a trace."""
    from tengyun.ops.quantize import quantize_folder

    _needs_kernel("bfloat16")
    folder = str(quantize_folder(tiny_checkpoints["llama"], tmp_path / scheme, scheme, 32).out_dir)
    llm = LLM(folder, dtype="bfloat16", **ARGS)
    graphs = llm.llm_engine.executor.runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 6]
    got = llm.generate(_prompts(), _params())
    _same_outputs(got, LLM(folder, dtype="bfloat16", enforce_eager=True, **ARGS).generate(_prompts(), _params()))
    assert all(graphs.steps[s] for s in graphs.sizes), graphs.steps


def test_a_trace_replays_writes_to_the_state_it_is_given():
    """The cache update nothing in the same forward reads back: replayed because the cache is
    one of the trace's inputs (as a constant its write would be dropped)."""
    from tengyun.platforms.cpu.runtime.graphs import trace_decode_forward

    cache, slot, x = torch.zeros(4, 3), torch.tensor([1]), torch.ones(1, 3)

    def forward():
        cache[slot] = cache[slot] + x
        return x * 2

    replay = trace_decode_forward(forward, [cache])  # 1 warm-up run, the trace, 1 first replay
    assert cache[1].tolist() == [3.0] * 3
    x.fill_(10.0)  # a static input changed between replays
    assert replay().tolist() == [[20.0] * 3]
    assert cache[1].tolist() == [13.0] * 3 and cache[0].tolist() == [0.0] * 3
    trace_decode_forward(forward, [cache], warm_ups=0)  # a later size: the trace and 1 first replay
    assert cache[1].tolist() == [33.0] * 3


def test_a_forward_that_cannot_be_traced_gives_none():
    from tengyun.platforms.cpu.runtime.graphs import trace_decode_forward

    assert trace_decode_forward(lambda: {"hidden": torch.zeros(2)}, []) is None  # a dict output


def test_a_trace_and_its_constants_go_with_the_replay():
    """A trace is not left in TorchScript's global compilation unit, where it (and the weights it
    holds as constants) lived until the process ended."""
    import gc
    import weakref

    from torch.jit import _state

    from tengyun.platforms.cpu.runtime.graphs import trace_decode_forward

    def traced_with_a_constant():
        weight, cache = torch.randn(8, 3), torch.zeros(2, 3)
        return trace_decode_forward(lambda: cache + weight[:2], [cache]), weakref.ref(weight)

    global_functions = len(_state._python_cu.get_functions())
    replay, held = traced_with_a_constant()
    assert replay is not None and len(_state._python_cu.get_functions()) == global_functions
    assert held() is not None  # the replay holds it
    del replay
    gc.collect()
    assert held() is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_dropped_or_shut_down_engine_frees_its_weights(tiny_checkpoints, arch):
    """Decode graphs traced and replayed, then the engine shut down (the LLM still referenced), or
    the LLM dropped without it: no parameter is left alive (the graphs held the embedding and
    Qwen2's qkv biases for the life of the process)."""
    import gc
    import weakref

    _needs_kernel("float32")
    for shut_down in (True, False):
        llm = LLM(str(tiny_checkpoints[arch]), dtype="float32", **ARGS)
        assert llm.llm_engine.executor.runner.decode_graphs is not None
        llm.generate(_prompts()[:2], _params()[:2])
        held = [weakref.ref(p) for p in llm.llm_engine.executor.model.parameters()]
        if shut_down:
            llm.llm_engine.shutdown()
            with pytest.raises(RuntimeError, match=r"engine was shut down .*build a new LLM"):
                llm.generate(_prompts()[:1], _params()[:1])
        else:
            del llm
        gc.collect()
        assert not [ref for ref in held if ref() is not None]
