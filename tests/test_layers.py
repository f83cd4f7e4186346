"""The three folders are three floors: the driver (`picompile/`) above the compiler (`passes/`) above the
runtime (`runtime/`). Imports run down only, and no module imports itself back through others, at any depth
of a function (a function-level import hides a circle from Python, not from this test)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ("picompile", "passes", "runtime")  # top to bottom


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(path: Path) -> str:
    return module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]


def imported_modules(source: str, package: str) -> set[str]:
    """Every project module `source` (a module of `package`) imports, relative imports resolved; `from package
    import name` counts as the module `package.name` where that is a module, else `package`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{alias.name}" for alias in node.names)
            found.add(base)
    return {name for name in found if name.split(".")[0] in FLOORS}


def project_graph() -> nx.DiGraph:
    modules = {module_name(p): p for floor in FLOORS for p in (ROOT / floor).rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for target in imported_modules(path.read_text(), package_of(path)):
            while target not in modules and "." in target:  # `from passes.ir import X`: X is no module
                target = target.rpartition(".")[0]
            if target in modules and target != name and not name.startswith(target + "."):
                graph.add_edge(name, target)
    return graph


def test_imports_run_from_the_driver_down_to_the_runtime():
    graph = project_graph()
    upward = [(a, b) for a, b in graph.edges
              if FLOORS.index(b.split(".")[0]) < FLOORS.index(a.split(".")[0])]
    assert not upward, f"imports that go up a floor: {upward}"
    assert graph.number_of_edges() > 100  # the walk saw the tree's imports (a broken walk would pass vacuously)


def test_no_module_imports_itself_back():
    graph = project_graph()
    # a package's __init__ importing its own modules is how packages work; drop those edges
    graph.remove_edges_from([(a, b) for a, b in list(graph.edges) if b.startswith(a + ".")])
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import circles: {cycles[:5]}"


def test_the_walk_sees_function_level_and_relative_imports():
    """The checks above are only as good as this: an import inside a function body counts, and a relative one
    is resolved against its package."""
    source = "def f():\n    from passes.reference import OrtDecoder\n    import runtime.engine\n    from ..ir import x\n"
    assert imported_modules(source, "passes.kernels") >= {"passes.reference", "runtime.engine", "passes.ir"}
