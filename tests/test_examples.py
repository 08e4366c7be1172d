"""The README's offline example runs as written and answers Paris."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parent.parent / "examples" / "offline_inference.py"


def test_readme_example_is_the_example_file():
    readme = (EXAMPLE.parent.parent / "README.md").read_text()
    body = EXAMPLE.read_text().split('"""', 2)[2].strip()
    assert body in readme


@pytest.mark.slow
def test_offline_example_runs_and_answers_paris():
    env = dict(os.environ, TENGYUN_CPU_KVCACHE_SPACE="0.5")
    proc = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("The capital of France is ->")
    assert "Paris" in lines[-1]
