"""No import cycle inside the orca_ext package.

Every orca_ext/**/*.py is parsed (never imported) and each `import` / `from ... import` that
names an orca_ext module becomes an edge, at module level or inside a function: an import hidden
in a function only postpones a cycle to the first call. Imports under `if TYPE_CHECKING:` are
left out, because they never run. `from pkg import name` points at the submodule `pkg.name` when
that is a Python module, else at `pkg` (importing anything from pkg runs pkg's __init__ first).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "orca_ext"


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def import_edges(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its body)."""
    modules = module_names(root, package)
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against the importing module's package
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem
                           for alias in node.names]
            for target in targets:
                # `import a.b.c` names a.b.c; stop at the longest prefix that is one of our modules.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` except the bodies of `if TYPE_CHECKING:` (their else-branches run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = {n: WHITE for n in edges}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        colour[n] = GREY
        stack.append(n)
        for m in sorted(edges[n]):
            if colour[m] == GREY:
                return stack[stack.index(m):] + [m]
            if colour[m] == WHITE and (cycle := visit(m)) is not None:
                return cycle
        stack.pop()
        colour[n] = BLACK
        return None

    for n in sorted(edges):
        if colour[n] == WHITE and (cycle := visit(n)) is not None:
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    edges = import_edges(ROOT, PACKAGE)
    # The walk sees module-level and function-level imports (cli imports the benchmark in main()).
    assert {"orca_ext.options", "orca_ext.benchmarks.throughput"} <= edges["orca_ext.cli"]
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import g\n")
    (pkg / "c.py").write_text("import pkg.sub.b\n")
    edges = import_edges(tmp_path, "pkg")
    assert edges["pkg.a"] == {"pkg.sub.b"} and edges["pkg.sub.b"] == {"pkg.a"} and edges["pkg.c"] == {"pkg.sub.b"}
    assert find_cycle(edges) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\n")  # b -> c -> b
    assert find_cycle(import_edges(tmp_path, "pkg")) == ["pkg.sub.b", "pkg.c", "pkg.sub.b"]
    # The package's __init__ importing a submodule that imports from the package is a cycle too.
    (pkg / "sub" / "b.py").write_text("import os\n")
    (pkg / "__init__.py").write_text("from .a import x\n")
    (pkg / "a.py").write_text("from . import version\n")
    assert find_cycle(import_edges(tmp_path, "pkg")) == ["pkg", "pkg.a", "pkg"]
    # ... but not when the import only serves type checkers.
    (pkg / "__init__.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n")
    assert find_cycle(import_edges(tmp_path, "pkg")) is None
