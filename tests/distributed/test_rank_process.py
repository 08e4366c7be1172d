"""A script that builds LLM(..., tensor_parallel_size=2) at its top level, with no
`if __name__ == "__main__":` guard, runs: ranks start as fresh interpreters that never re-run it
(or by fork when asked). Real scripts in subprocesses, real ranks over gloo."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from tengyun import LLM, SamplingParams
from tengyun.executor.rank_process import METHOD_ENVS, start_method
from tengyun.platforms import platform_class

PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11]]
PARAMS = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
SHAPE = dict(block_size=8, max_model_len=64, kv_cache_memory="1MiB", device="cpu", dtype="float32")

UNGUARDED = """
import json, logging
from tengyun import LLM, SamplingParams

logging.basicConfig(level=logging.INFO)
llm = LLM({model!r}, tensor_parallel_size=2, **{shape!r})
outputs = llm.generate({prompts!r}, SamplingParams(**{params!r}))
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outputs]))
"""

# The user's own spawned child re-runs this top level while it bootstraps, LLM(...) included.
UNGUARDED_WITH_OWN_SPAWN = """
import logging, multiprocessing, os
from tengyun import LLM

logging.basicConfig(level=logging.INFO)
llm = LLM({model!r}, **{shape!r})
child = multiprocessing.get_context("spawn").Process(target=os.getpid)
child.start()
child.join(120)
print("CHILD EXIT", child.exitcode)
"""


def _run(tmp_path, source: str, **env) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(source)
    clean = {k: v for k, v in os.environ.items() if k not in METHOD_ENVS}
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env={**clean, **env},
                          capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("env,method", [
    ({}, "spawn"),
    ({"VLLM_WORKER_MULTIPROC_METHOD": "fork"}, "fork"),  # vLLM's variable is honoured
])
def test_unguarded_script_runs_tp2_with_tp1_greedy_tokens(tiny_checkpoints, tmp_path, env, method):
    model = str(tiny_checkpoints["llama"])
    llm = LLM(model, **SHAPE)  # tp 1, in this process
    try:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(**PARAMS))]
    finally:
        llm.llm_engine.shutdown()
    done = _run(tmp_path, UNGUARDED.format(model=model, shape=SHAPE, prompts=PROMPTS, params=PARAMS), **env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"Starting ranks [0, 1] with {method}" in done.stderr
    assert json.loads(done.stdout.split("TOKENS", 1)[1]) == expected


def test_llm_in_an_unguarded_script_refuses_to_load_in_a_spawned_child_naming_the_guard(tiny_checkpoints,
                                                                                       tmp_path):
    done = _run(tmp_path, UNGUARDED_WITH_OWN_SPAWN.format(model=str(tiny_checkpoints["llama"]), shape=SHAPE))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CHILD EXIT 1" in done.stdout
    assert "RuntimeError: LLM(...) was called while multiprocessing was starting this process" in done.stderr
    assert 'Put the code that builds the LLM under `if __name__ == "__main__":`' in done.stderr
    assert done.stderr.count("Loaded LlamaForCausalLM") == 1  # this process's; the child refused before loading


def test_start_method_is_spawn_unless_fork_is_asked_for(monkeypatch):
    for name in METHOD_ENVS:
        monkeypatch.delenv(name, raising=False)
    assert start_method(fork_safe=True) == "spawn"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    assert start_method(fork_safe=True) == "fork"
    monkeypatch.setenv("TENGYUN_WORKER_MULTIPROC_METHOD", "spawn")  # ours wins over vLLM's
    assert start_method(fork_safe=True) == "spawn"


def test_fork_falls_back_to_spawn_where_the_device_runtime_does_not_survive_it(monkeypatch, caplog):
    monkeypatch.delenv("TENGYUN_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    assert platform_class("cpu").fork_safe
    for device in ("cuda", "npu"):
        with caplog.at_level(logging.WARNING):
            assert start_method(platform_class(device).fork_safe) == "spawn"
        assert "VLLM_WORKER_MULTIPROC_METHOD=fork ignored" in caplog.text


def test_unknown_start_method_names_the_variable(monkeypatch):
    monkeypatch.setenv("TENGYUN_WORKER_MULTIPROC_METHOD", "forkserver")
    with pytest.raises(ValueError, match="TENGYUN_WORKER_MULTIPROC_METHOD must be spawn or fork; got 'forkserver'"):
        start_method(fork_safe=True)
