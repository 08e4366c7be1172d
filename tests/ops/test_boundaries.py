"""STYLE boundaries of ops/, host/ and sizing/: no engine or torch imports; only host/probe.py touches the machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "tengyun"
MODULES = ("host.compat", "ops.doctor", "ops.grafana", "ops.monitoring", "host.numa", "ops.plan",
           "host.probe", "host.ranktable", "host.smi", "host.telemetry", "host.findings", "host.versions",
           "sizing.blocks", "sizing.cache", "sizing.checkpoint", "sizing.model_size", "sizing.plan",
           "sizing.platform_facts", "sizing.resolve", "sizing.weights")


def test_ops_modules_import_neither_torch_nor_the_engine():
    code = ("import sys\n"
            + "".join(f"import tengyun.{m}\n" for m in MODULES)
            + "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('tengyun.engine', "
              "'tengyun.worker', 'tengyun.models', 'tengyun.layers', 'tengyun.executor', 'tengyun.distributed')))\n"
              "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_only_probe_shells_out_or_reads_sysfs():
    for module in MODULES:
        if module == "host.probe":
            continue
        source = (PACKAGE / f"{module.replace('.', '/')}.py").read_text()
        for marker in ("subprocess", "/sys/", "/proc/", "sched_setaffinity", "ctypes", "shutil.which"):
            assert marker not in source, f"{module} uses {marker}: move it to host/probe.py"


def test_the_model_spec_and_kv_sizing_are_torch_free():
    """`tengyun plan` and the engine share these modules (and the one resolve of their settings, for
    any device, none of them here), so a planning host needs no torch."""
    code = ("import sys, json\n"
            "import tengyun.model_spec, tengyun.sizing.cache, tengyun.ops.plan\n"
            "from tengyun.config import EngineConfig\n"
            "from tengyun.model_spec import as_spec\n"
            "from tengyun.sizing.plan import make_plan\n"
            "from tengyun.sizing.resolve import resolve_sizing\n"
            "cfg = json.load(open(sys.argv[1])); spec = as_spec(cfg)\n"
            "for device in ('npu', 'cuda'): make_plan(cfg, resolve_sizing(EngineConfig(), spec, device))\n"
            "make_plan(cfg, resolve_sizing(EngineConfig(kv_cache_memory=2**30), spec, 'cpu'))\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('tengyun.engine', "
            "'tengyun.worker', 'tengyun.models', 'tengyun.layers', 'tengyun.executor', 'tengyun.distributed'))))\n")
    config = Path(__file__).parents[1] / "fixtures" / "ops" / "qwen3_5_397b_a17b" / "config.json"
    out = subprocess.run([sys.executable, "-c", code, str(config)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
