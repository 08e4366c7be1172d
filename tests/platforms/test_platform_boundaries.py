"""STYLE boundaries around platforms/: layers and models never reach for a platform (kernels
come to them in one bundle, tengyun/layers/kernels.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "tengyun"


def test_layers_and_models_never_import_platforms():
    """Not even inside a function: the kernels a layer computes with reach it through bind_kernels."""
    found = []
    for folder in ("layers", "models"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(n == "tengyun.platforms" or n.startswith("tengyun.platforms.") for n in names):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


def test_importing_every_layer_and_model_leaves_platforms_unimported():
    code = ("import importlib, pkgutil, sys\n"
            "import tengyun.layers, tengyun.models\n"
            "for package in (tengyun.layers, tengyun.models):\n"
            "    for module in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
            "        importlib.import_module(module.name)\n"
            "print(sorted(m for m in sys.modules if m.startswith('tengyun.platforms')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
