"""--enable-expert-parallel with real worker processes over gloo: experts divided whole among the
TP ranks give the single-process engine's greedy tokens and top-5 logprobs (as does the default,
every rank holding a slice of every expert, also where the expert count does not divide the ranks);
an expert count the ranks cannot share whole is refused at start-up; a rank reads only its experts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tengyun import LLM, SamplingParams

MAX_TOKENS, TOP_K = 8, 5
ENGINE_ARGS = dict(block_size=8, max_model_len=104, max_num_batched_tokens=32, max_num_seqs=8,
                   kv_cache_memory="1MiB", dtype="float32")
PROMPTS = [[(11 * i + j) % 290 + 1 for j in range(n)] for i, n in enumerate((3, 17, 40, 9))]


def _generate(folder, **parallel) -> list:
    llm = LLM(str(folder), **ENGINE_ARGS, **parallel)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    try:
        return [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    finally:
        llm.llm_engine.shutdown()


def _assert_same(outputs, reference) -> None:
    for got, want in zip(outputs, reference, strict=True):
        assert got.token_ids == want.token_ids
        for step, (got_top, want_top) in enumerate(zip(got.logprobs, want.logprobs)):
            for token, entry in want_top.items():
                assert got_top[token].logprob == pytest.approx(entry.logprob, abs=1e-4), (step, token)


@pytest.fixture(scope="module")
def per_expert_qwen3_5_moe(tmp_path_factory, tiny_tokenizer_dir):
    from models.checkpoint_layouts import LAYOUTS, write_layout

    folder = tmp_path_factory.mktemp("qwen3_5_moe_per_expert")
    return write_layout(folder, tiny_tokenizer_dir, LAYOUTS["qwen3_5_moe-wrapper-per-expert"])


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe", "qwen3_5_moe-per-expert"])
def test_tp2_with_expert_parallel_matches_one_process(tiny_checkpoints, tiny_hybrid_checkpoints,
                                                     per_expert_qwen3_5_moe, arch, capfd):
    folders = {**tiny_checkpoints, **tiny_hybrid_checkpoints, "qwen3_5_moe-per-expert": per_expert_qwen3_5_moe}
    reference = _generate(folders[arch])
    _assert_same(_generate(folders[arch], tensor_parallel_size=2, enable_expert_parallel=True), reference)
    logged = capfd.readouterr().err
    assert "rank 1 is expert-parallel rank 1 of 2" in logged and "rank 0 is expert-parallel rank 0 of 2" in logged


def test_default_tp_slices_every_expert_so_any_expert_count_runs(tmp_path, tiny_tokenizer_dir):
    from conftest import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path, tiny_tokenizer_dir, "qwen3_moe", num_experts=3)
    _assert_same(_generate(folder, tensor_parallel_size=2), _generate(folder))


def test_uneven_expert_count_is_refused_at_start_up(tmp_path, tiny_tokenizer_dir):
    from conftest import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path, tiny_tokenizer_dir, "qwen3_moe", num_experts=3)
    run = subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "serve", str(folder), "-tp", "2",
                          "--enable-expert-parallel", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert ("--enable-expert-parallel divides the 3 experts of each MoE layer whole among the 2 expert-parallel "
            "ranks (--tensor-parallel-size 2), but 2 does not divide 3") in run.stderr


def test_an_expert_parallel_rank_plans_only_its_own_experts(per_expert_qwen3_5_moe, monkeypatch):
    """Rank 1 of 2 (8 experts): the load plan names experts 4-7 only; the other rank's tensors are never read."""
    from tengyun.config import EngineConfig
    from tengyun.distributed import parallel_state
    from tengyun.models import loader
    from tengyun.models.registry import model_class_for

    monkeypatch.setattr(parallel_state, "_STATE", parallel_state._State(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2))
    config = EngineConfig(model=str(per_expert_qwen3_5_moe), device="cpu", tensor_parallel_size=2,
                          enable_expert_parallel=True).finalize()
    model = model_class_for(config)(config.model_spec, config.max_model_len, torch.float32)
    stored = loader._stored_tensors(loader.safetensors_files(config.model_path))
    experts = {int(name.split(".experts.")[1].split(".")[0]) for _, name, _ in loader._plan(model, stored,
                                                                                             config.model_path)
               if ".experts." in name}
    assert experts == {4, 5, 6, 7}
    assert any(".experts.0." in name for name in stored)  # the checkpoint holds them all


def test_quantised_experts_with_expert_parallel_match_one_process(tiny_tokenizer_dir, tmp_path, monkeypatch):
    """A Qwen3-MoE .gguf kept quantised (gate/up Q8_0, down Q4_0): each EP rank holds 4 of the 8
    experts' blocks; tokens and top-5 logprobs as one process's, in float32."""
    pytest.importorskip("gguf", reason="the gguf package is not installed")
    from pathlib import Path

    from conftest import make_tiny_checkpoint

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "quantization"))
    monkeypatch.setenv("TENGYUN_CACHE_DIR", str(tmp_path / "cache"))
    from gguf_files import write_gguf

    hf = make_tiny_checkpoint(tmp_path / "hf", tiny_tokenizer_dir, "qwen3_moe", mlp_only_layers=[])
    types = {"ffn_gate_exps.weight": "Q8_0", "ffn_up_exps.weight": "Q8_0", "ffn_down_exps.weight": "Q4_0"}
    path = write_gguf(hf, tmp_path / "tiny-moe.gguf", types, twin=tmp_path / "twin")
    _assert_same(_generate(path, quantization="gguf", tensor_parallel_size=2, enable_expert_parallel=True),
                 _generate(path, quantization="gguf"))
