"""The CPU model thread's OpenMP threads bound one per CPU (platforms/cpu/runtime/thread_binding.py):
the setting's parsing and checks, and, in a fresh process (binding changes the threads of the
process it runs in), a real engine's threads read back from /proc after steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tengyun import LLM
from tengyun.platforms.cpu.runtime.thread_binding import (
    BIND_ENV, VLLM_BIND_ENV, bind_setting, format_cpus, one_cpu_per_core, parse_cpu_list, planned_cpus,
)

ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def fake_sysfs(root: Path, cores: dict[int, tuple[int, int]]) -> Path:
    """/sys/devices/system/cpu as Linux lays it out: cpuN/topology/{physical_package_id, core_id}."""
    for cpu, (package, core) in cores.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    return root


def test_a_cpu_list_reads_as_linux_and_vllm_write_it():
    assert parse_cpu_list("0-3,6", BIND_ENV) == [0, 1, 2, 3, 6]
    assert parse_cpu_list("4, 1,1-2", BIND_ENV) == [4, 1, 2]  # order kept, repeats dropped
    assert format_cpus([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    for bad in ("a", "3-1", "0-", "0,,1"):
        with pytest.raises(ValueError, match=BIND_ENV):
            parse_cpu_list(bad, BIND_ENV)


def test_auto_takes_the_first_logical_cpu_of_each_physical_core(tmp_path):
    # Two cores with two hyperthreads each, numbered as Linux does on x86: siblings are n and n + 2.
    sysfs = fake_sysfs(tmp_path, {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)})
    assert one_cpu_per_core([0, 1, 2, 3], sysfs) == [0, 1]
    assert one_cpu_per_core([1, 2], sysfs) == [1, 2]  # the process may use one thread of each core
    assert planned_cpus(2, 1, [0, 1, 2, 3], ("", "auto"), sysfs) == ([0, 1], "auto (the default): one core each")
    cpus, why = planned_cpus(3, 1, [0, 1, 2, 3], ("", "auto"), sysfs)
    assert cpus is None and "3 threads, 2 cores this process may use" in why
    # Fewer threads than cores: a data-parallel replica's share; the other replicas hold the rest.
    cpus, why = planned_cpus(1, 1, [0, 1, 2, 3], ("", "auto"), sysfs)
    assert cpus is None and "1 thread, 2 cores this process may use; a CPU list binds them anyway" in why
    assert planned_cpus(1, 1, [0, 1, 2, 3], (BIND_ENV, "1"), sysfs)[0] == [1]
    assert one_cpu_per_core([0, 1], tmp_path / "missing") == [0, 1]  # no topology: the list as it is


def test_a_setting_that_cannot_be_met_is_an_error_naming_the_variable(tmp_path):
    sysfs = fake_sysfs(tmp_path, {0: (0, 0), 1: (0, 1)})
    with pytest.raises(ValueError, match=rf"{BIND_ENV}='0,5': CPU 5 is not one this process may use \(0-1\)"):
        planned_cpus(2, 1, [0, 1], (BIND_ENV, "0,5"), sysfs)
    with pytest.raises(ValueError, match="lists 1 CPUs for 2 OpenMP threads.*OMP_NUM_THREADS=1"):
        planned_cpus(2, 1, [0, 1], (BIND_ENV, "1"), sysfs)
    with pytest.raises(ValueError, match=r"per-rank CPU lists \('\|'\) are not supported"):
        planned_cpus(1, 1, [0, 1], (VLLM_BIND_ENV, "0|1"), sysfs)
    with pytest.raises(ValueError, match="this engine has 2 ranks"):
        planned_cpus(1, 2, [0, 1], (BIND_ENV, "0"), sysfs)
    assert planned_cpus(1, 2, [0, 1], ("", "auto"), sysfs)[0] is None  # ranks share the cores: unbound
    unbound = (None, f"{BIND_ENV}=nobind: OpenMP threads unbound")
    assert planned_cpus(2, 1, [0, 1], (BIND_ENV, "nobind"), sysfs) == unbound
    assert planned_cpus(2, 1, [0, 1], (BIND_ENV, "1,0"), sysfs) == ([1, 0], f"{BIND_ENV}=1,0")


def test_vllms_variable_counts_where_ours_is_unset(monkeypatch):
    monkeypatch.delenv(BIND_ENV, raising=False)
    monkeypatch.delenv(VLLM_BIND_ENV, raising=False)
    assert bind_setting() == ("", "auto")
    monkeypatch.setenv(VLLM_BIND_ENV, "nobind")
    assert bind_setting() == (VLLM_BIND_ENV, "nobind")
    monkeypatch.setenv(BIND_ENV, "0")
    assert bind_setting() == (BIND_ENV, "0")


def test_an_engine_with_an_impossible_cpu_list_does_not_start(tiny_checkpoints, monkeypatch):
    monkeypatch.setenv(BIND_ENV, f"0,{max(ALLOWED, default=0) + 1}")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    with pytest.raises(ValueError, match=f"{BIND_ENV}=.* is not one this process may use"):
        LLM(str(tiny_checkpoints["llama"]), block_size=8, max_model_len=64, kv_cache_memory="1MiB")


# Runs in a fresh process: an engine steps (twice, its OpenMP pool released between), and every
# thread's affinity is read from /proc (inside a step for the model thread); then the op is called
# directly.
PROBE = r"""
import json, os, sys, torch
from tengyun import LLM, SamplingParams
from tengyun.platforms.cpu.runtime.threads import release_openmp_pool

def affinities():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            line = next(l for l in f if l.startswith("Cpus_allowed_list:"))
        out[int(tid)] = line.split(":")[1].strip()
    return out

llm = LLM(sys.argv[1], block_size=8, max_model_len=64, max_num_seqs=4, kv_cache_memory="1MiB")
worker = llm.llm_engine.executor
inside, run = [], worker.runner.execute
def execute(*args):
    inside.append(sorted(os.sched_getaffinity(0)))
    return run(*args)
worker.runner.execute = execute
before = sorted(os.sched_getaffinity(0))
params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
tokens = llm.generate(["The quick brown fox"], params)
# The pool ends (as when another engine is built in this thread) and libgomp starts a new one in
# the next step: its thread must be placed again, not inherit the pinned model thread's one CPU.
release_openmp_pool()
again = llm.generate(["The quick brown fox"], params)
assert again[0].outputs[0].token_ids == tokens[0].outputs[0].token_ids
result = {"before": before, "after": sorted(os.sched_getaffinity(0)), "inside": inside,
          "threads": affinities(), "main": os.getpid(), "tokens": tokens[0].outputs[0].token_ids}
if worker.step_threads is not None and worker.step_threads.binding is not None:
    result["where"] = torch.ops.tengyun.set_openmp_worker_affinity(2, [before[1], before[0]], True)
    try:
        torch.ops.tengyun.set_openmp_worker_affinity(2, [before[0], max(before) + 1], True)
    except RuntimeError as e:
        result["refused"] = str(e).splitlines()[0]
print("RESULT " + json.dumps(result))
"""


def probe(folder: str, **env: str) -> dict:
    run_env = {k: v for k, v in os.environ.items() if k not in (BIND_ENV, VLLM_BIND_ENV)}
    run_env.update(OMP_NUM_THREADS="2", **env)  # a fixed count: the tuner never drops a thread here
    done = subprocess.run([sys.executable, "-c", PROBE, folder], env=run_env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


CORES = one_cpu_per_core(ALLOWED) if ALLOWED else []
needs_two_cpus = pytest.mark.skipif(len(CORES) < 2 or not Path("/proc/self/task").is_dir(),
                                    reason="binding two threads needs two cores and Linux's /proc")


@needs_two_cpus
def test_the_engine_pins_its_openmp_threads_for_steps_and_gives_the_model_thread_its_cpus_back(tiny_checkpoints):
    from tengyun.platforms.cpu import native

    if native.load_error() is not None:
        pytest.skip(f"the CPU kernels are not loaded: {native.load_error()}")
    first, second = CORES[:2]
    # auto where this machine has the 2 cores the probe's 2 threads fill (CI's); else the same two by list
    setting = {} if len(CORES) == 2 else {BIND_ENV: f"{first},{second}"}
    bound = probe(str(tiny_checkpoints["llama"]), **setting)
    unbound = probe(str(tiny_checkpoints["llama"]), **{BIND_ENV: "nobind"})
    everything = format_cpus(ALLOWED)
    # The model thread: pinned to the first core inside every step, its own CPUs back after.
    assert bound["inside"] and all(cpus == [first] for cpus in bound["inside"])
    assert bound["before"] == bound["after"] == ALLOWED
    # The pool's other thread: on the second core, for good; every other thread keeps all CPUs.
    pinned = {tid: cpus for tid, cpus in bound["threads"].items() if cpus != everything}
    # (the released pool's thread may still be exiting: every pinned thread, the new one included)
    assert pinned and set(pinned.values()) == {str(second)} and bound["main"] not in map(int, pinned)
    assert bound["where"] == [-1, first]  # the op placed the worker where it was asked to
    assert f"OpenMP thread 1 could not be placed on CPU {max(ALLOWED) + 1}" in bound["refused"]
    # nobind: nothing pinned, and the same greedy tokens either way.
    assert all(cpus == ALLOWED for cpus in unbound["inside"])
    assert set(unbound["threads"].values()) == {everything} and "where" not in unbound
    assert bound["tokens"] == unbound["tokens"]
