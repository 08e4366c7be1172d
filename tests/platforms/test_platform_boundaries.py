"""STYLE boundaries around platforms/: only platforms/ (and host/ and ops/, which probe devices by name)
knows device names, and layers and models never reach for a platform (kernels come to them in
one bundle, tengyun/layers/kernels.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "tengyun"
DEVICE_NAMES = {"cpu", "cuda", "npu"}
KNOWS_DEVICE_NAMES = ("platforms", "host", "ops")  # folders of tengyun/ allowed to branch on them
# "path: stripped source line" of a branch allowed to stay for now -> why.
ALLOWED: dict[str, str] = {}


def _names_a_device(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in DEVICE_NAMES
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_names_a_device(e) for e in node.elts)


def device_branches(source: str) -> list[int]:
    """Lines comparing something with a device name: ``x == "cpu"``, ``x != "cuda"``, ``x in
    ("cuda", "npu")``, ``x.startswith("npu")``. Device names inside other strings (messages,
    help) and other names ("meta") are not branches."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            if any(_names_a_device(operand) for operand in [node.left, *node.comparators]):
                lines.add(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith") and any(map(_names_a_device, node.args))):
            lines.add(node.lineno)
    return sorted(lines)


def test_the_scan_finds_each_form_of_device_branch():
    source = ("a = device_type == 'cpu'\n"
              "b = 'cuda' != device.type\n"
              "c = device.type in ('cuda', 'npu')\n"
              "d = name.startswith('npu')\n"
              "e = device.type == 'meta'\n"
              "raise ValueError(f'--device cpu was requested but {x} == cuda')\n"
              "f = {'cpu': 1}[device_type]\n")
    assert device_branches(source) == [1, 2, 3, 4]


def test_only_platforms_branch_on_device_names():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[1] in KNOWS_DEVICE_NAMES:
            continue
        lines = path.read_text().splitlines()
        for line in device_branches(path.read_text()):
            if f"{relative}: {lines[line - 1].strip()}" not in ALLOWED:
                found.append(f"{relative}:{line}: {lines[line - 1].strip()}")
    assert not found, ("device-name branches outside tengyun/platforms/ (make them a Platform attribute "
                       "or method):\n" + "\n".join(found))


def test_allowed_branches_still_exist():
    """An entry whose line is gone (moved onto the platform) is removed from ALLOWED."""
    for entry in ALLOWED:
        path, line = entry.split(": ", 1)
        assert line in (ROOT / path).read_text(), f"{entry!r} is gone: remove it from ALLOWED"


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
