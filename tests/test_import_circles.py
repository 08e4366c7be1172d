"""No import circle spans two top-level folders of tengyun/ (imports inside functions included).

A circle inside one folder (a registry and its entries) is allowed; one that crosses folders means
a lower layer asks an upper one (STYLE lesson 16), which a function-level import only hides."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "tengyun"


def module_names(root: Path) -> dict[str, Path]:
    """'tengyun.platforms.base' -> its file, for every module and package under ``root``."""
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its source (``from a.b import c`` counts
    a.b, and a.b.c where that is a module)."""
    modules = module_names(root)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in map(known, targets) if t and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for start in list(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, edges = work[-1]
            child = next((e for e in edges), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def top_folder(module: str) -> str:
    """'tengyun.platforms.cpu.runtime' -> 'platforms'; 'tengyun.model_spec' -> 'model_spec'."""
    return module.split(".")[1] if "." in module else module


def test_the_scan_finds_a_circle_closed_inside_a_function(tmp_path):
    root = tmp_path / "tengyun"
    (root / "low").mkdir(parents=True)
    (root / "high").mkdir()
    for folder in ("", "low", "high"):
        (root / folder / "__init__.py").write_text("")
    (root / "low" / "facts.py").write_text("def f():\n    from tengyun.high.policy import g\n    return g\n")
    (root / "high" / "policy.py").write_text("from tengyun.low import facts\n\n\ndef g():\n    return facts\n")
    (root / "high" / "registry.py").write_text("from . import entry\n")
    (root / "high" / "entry.py").write_text("from tengyun.high import registry\n")
    found = circles(import_graph(root))
    assert sorted(found) == [["tengyun.high.entry", "tengyun.high.registry"],
                             ["tengyun.high.policy", "tengyun.low.facts"]]


def test_no_import_circle_spans_two_top_level_folders():
    crossing = [c for c in circles(import_graph(PACKAGE)) if len({top_folder(m) for m in c}) > 1]
    assert not crossing, "import circles across top-level folders (a lower layer asks an upper one):\n" + \
        "\n".join(" <-> ".join(c) for c in crossing)
