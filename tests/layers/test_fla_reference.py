"""Runs tests/layers/fla_reference_checks.py in its own process with flash-linear-attention
on the path (.venv/fla-site, installed by `make setup`), so fla never reaches transformers in
this process; every test there must run, none skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FLA_SITE = Path(sys.prefix) / "fla-site"
TESTS = Path(__file__).with_name("fla_reference_checks.py")


def test_gated_delta_rule_matches_fla_references_in_a_separate_process():
    if not (FLA_SITE / "fla").is_dir():
        pytest.fail(f"{FLA_SITE} has no fla: run `make setup` (it installs fla-core there)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(FLA_SITE), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(TESTS)],
                            cwd=Path(__file__).parents[2], env=env, capture_output=True, text=True, timeout=600)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0 and "skipped" not in summary and "passed" in summary, result.stdout[-4000:]
