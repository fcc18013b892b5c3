"""The layout is the architecture: lower layers never import higher ones, and no package imports itself in a circle.

Every `import` in the project's packages is read with `ast`, also those inside functions (a lazy import is still a
dependency). Layers, bottom to top: foundation; agent, rewards, data, models; inference; backends; jobs;
analysis.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYER = {
    "foundation": 0,
    "agent": 1,
    "rewards": 1,
    "data": 1,
    "models": 1,
    "inference": 2,
    "backends": 3,
    "jobs": 4,
    "analysis": 5,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in its body)."""
    graph: dict[str, set[str]] = {}
    for package in LAYER:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = module_name(path)
            found: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found |= {alias.name for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    found.add(node.module)
                    found |= {f"{node.module}.{alias.name}" for alias in node.names}
            graph[name] = {m for m in found if m.split(".")[0] in LAYER}
    modules = set(graph)
    # `from a.b import c` names a module only where a.b.c is one
    return {name: {m for m in deps if m in modules} - {name} for name, deps in graph.items()}


def test_no_layer_imports_a_higher_one() -> None:
    wrong = [
        f"{name} imports {dep}"
        for name, deps in imports().items()
        for dep in deps
        if LAYER[dep.split(".")[0]] > LAYER[name.split(".")[0]]
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", ["inference", "backends", "backends.verl", "backends.trl", "jobs"])
def test_no_import_circle(package: str) -> None:
    graph = {n: {d for d in deps if d.startswith(package + ".")} for n, deps in imports().items()}
    graph = {n: deps for n, deps in graph.items() if n.startswith(package + ".")}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(node) :], node]))
        if node in done:
            return
        for dep in sorted(graph.get(node, ())):
            visit(dep, [*path, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
