"""Start-up fails fast on a broken NPU stack: `tengyun serve --device npu` as a real subprocess,
with a stub torch_npu placed on PYTHONPATH (one that raises on import, one that hangs, one whose
version does not match torch), exits 2 naming the fix; `--device auto` logs what it passed over."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tengyun.platforms.startup import DeviceStartupError, device_init_timeout, run_child_probe, select_platform

STUBS = {
    "raises": 'raise ImportError("libascendcl.so: cannot open shared object file: No such file or directory")\n',
    "hangs": "import time\ntime.sleep(600)  # an ACL initialisation that never returns\n",
    # imports, but is the build for torch 2.1.0 (CANN 8.0.0), not for the torch installed here
    "mismatch": '__version__ = "2.1.0.post10"\n',
}


def stub_torch_npu(root: Path, kind: str) -> Path:
    """A folder holding a torch_npu package that behaves as STUBS[kind] (with pip metadata for "mismatch")."""
    folder = root / kind
    (folder / "torch_npu").mkdir(parents=True)
    (folder / "torch_npu" / "__init__.py").write_text(STUBS[kind])
    if kind == "mismatch":
        meta = folder / "torch_npu-2.1.0.post10.dist-info"
        meta.mkdir()
        meta.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: torch-npu\nVersion: 2.1.0.post10\n")
    return folder


def start_serve(model: Path, stub: Path, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "tengyun.entrypoints.cli.main", "serve", str(model), "--port", "1",
                             "--device", "npu", *flags],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_serve_device_npu_exits_2_naming_the_fix_for_each_broken_runtime(tiny_checkpoints, tmp_path):
    model = tiny_checkpoints["llama"]
    # The probe child imports torch before torch_npu: the hang case's limit leaves that import time on a
    # loaded machine, and only the hanging stub ever reaches its limit.
    hang_limit, no_limit = ["--device-init-timeout", "20"], ["--device-init-timeout", "300"]
    cases = {  # name -> (stub, extra flags, what stderr must say)
        "raises": ("raises", no_limit, ["error: --device npu was requested but torch_npu is not importable: "
                                        "ImportError: libascendcl.so: cannot open shared object file",
                                        "source /usr/local/Ascend/ascend-toolkit/set_env.sh"]),
        "hangs": ("hangs", hang_limit, ["error: --device npu was requested but the NPU runtime hung: "
                                        "`import torch_npu` did not finish within 20 s (--device-init-timeout, "
                                        "$TENGYUN_DEVICE_INIT_TIMEOUT): loading CANN and ACL hung",
                                "raise --device-init-timeout"]),
        "mismatch": ("mismatch", no_limit, ["known-bad version combination",
                                      "torch_npu 2.1.0.post10 is built for torch 2.1.0 but torch",
                                      "pip install torch==2.1.0, or a torch_npu for torch",
                                      "pass --skip-version-check to start anyway"]),
        # the override skips the version table; the stub then fails at its first device call
        "mismatch skipped": ("mismatch", ["--skip-version-check", *no_limit],
                             ["error: --device npu was requested but `torch.npu.is_available()` failed"]),
    }
    stubs = {kind: stub_torch_npu(tmp_path, kind) for kind in STUBS}
    procs = {name: start_serve(model, stubs[stub], *flags) for name, (stub, flags, _) in cases.items()}
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, (name, stderr)
        for expected in cases[name][2]:
            assert expected in stderr, (name, expected, stderr)
        assert "Traceback" not in stderr, (name, stderr)


def test_auto_logs_why_it_passed_over_an_installed_but_broken_torch_npu(tmp_path, monkeypatch, caplog):
    stub = stub_torch_npu(tmp_path, "raises")
    monkeypatch.syspath_prepend(str(stub))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(stub), os.environ.get("PYTHONPATH", "")]))
    with caplog.at_level(logging.INFO, logger="tengyun.platforms.startup"):
        assert select_platform("auto", init_timeout_s=60, check_versions=False).device_type == "cpu"
    text = caplog.text
    assert "--device auto: npu is installed but unusable: torch_npu is not importable: ImportError: libascendcl.so" \
           in text
    assert "--device auto chose cpu (tried npu: torch_npu is not importable" in text
    assert "cuda: torch " in text  # this host's torch is a CPU build, named as the reason


def test_auto_without_torch_npu_notes_it_is_not_installed(caplog):
    with caplog.at_level(logging.INFO, logger="tengyun.platforms.startup"):
        assert select_platform("auto", init_timeout_s=60).device_type == "cpu"
    assert "tried npu: torch_npu is not installed" in caplog.text


def test_device_cuda_on_a_cpu_build_names_the_missing_piece():
    with pytest.raises(DeviceStartupError, match="--device cuda was requested but torch .* is a build without CUDA: "
                                                 "install a CUDA build of torch"):
        select_platform("cuda", init_timeout_s=60)


def test_child_probe_reports_the_step_that_hung():
    probe = run_child_probe("print('STEP one', flush=True)\nprint('STEP two', flush=True)\n"
                            "import time\ntime.sleep(600)\n", timeout_s=2)
    assert probe.timed_out and probe.steps == ["one", "two"] and probe.last_step == "two" and probe.result is None


def test_device_init_timeout_comes_from_the_flag_then_the_environment(monkeypatch):
    monkeypatch.delenv("TENGYUN_DEVICE_INIT_TIMEOUT", raising=False)
    assert device_init_timeout(None) == 120.0
    monkeypatch.setenv("TENGYUN_DEVICE_INIT_TIMEOUT", "30")
    assert device_init_timeout(None) == 30.0 and device_init_timeout(7.5) == 7.5
    monkeypatch.setenv("TENGYUN_DEVICE_INIT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"\$TENGYUN_DEVICE_INIT_TIMEOUT must be seconds"):
        device_init_timeout(None)


# A torch_npu that imports and reports one healthy 910B (its device steps stood in for on the CPU).
HEALTHY_NPU = ("import types, torch\n"
               "_zeros = torch.zeros\n"
               "torch.zeros = lambda *a, device=None, **k: _zeros(*a, **k)\n"
               "torch.npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 1,\n"
               "    set_device=lambda i: None, synchronize=lambda: None, get_device_name=lambda i=0: 'Ascend910B3')\n")


@pytest.mark.parametrize("scatter", [False, True], ids=["atb-cache-write", "scatter-cache-write"])
def test_npu_start_up_needs_nnal_only_where_the_cache_write_is_atbs(tmp_path, monkeypatch, scatter):
    """No libatb.so here: a torch_npu without npu_scatter_pa_kv_cache (its cache write is ATB's
    _npu_reshape_and_cache) is refused at start-up naming NNAL's set_env.sh; one with it starts."""
    from tengyun.platforms.npu.platform import NpuPlatform

    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(
        HEALTHY_NPU + ("npu_scatter_pa_kv_cache = lambda **kwargs: None\n" if scatter else ""))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    problem = NpuPlatform.runtime_problem(timeout_s=300)
    if scatter:
        assert problem is None
    else:
        assert problem.what.startswith("NNAL's ATB library, which its KV-cache write (_npu_reshape_and_cache) needs, "
                                       "does not load (libatb.so")
        assert "source /usr/local/Ascend/nnal/atb/set_env.sh" in problem.fix and problem.installed
