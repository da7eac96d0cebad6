"""No import cycles inside deepspeed_c: the layers of ARCHITECTURE.md ("Which way the imports run") import
downwards only, so no module can reach itself through the imports it runs when it is first imported.

The graph is read from the source, not from a live import (which would hide a cycle that happens to
resolve in the order the test imports things). Every .py under deepspeed_c/ is parsed; an edge A -> B is a
statement that runs while A is being imported and names B, a deepspeed_c module:

- `import deepspeed_c.x.y` -> deepspeed_c.x.y; `from deepspeed_c.x import y` -> deepspeed_c.x.y when y is a
  submodule, else deepspeed_c.x (the package's __init__); relative imports are resolved against A's package.
- Edges go to the module named and to the packages above it that are not above A: importing
  deepspeed_c.x.y.z from outside deepspeed_c.x.y runs deepspeed_c.x.y's __init__ first (if it is not imported
  yet); the packages above A are in sys.modules already (initialising), so importing a sibling does not
  re-enter them.

Left out, because they do not run when A is imported: imports inside functions and methods (late
imports, which is how a module legitimately reaches up a layer), imports under `if TYPE_CHECKING:`, and
the fallback imports in the `except ImportError:` handlers of a try (the try's own body does run, so its
imports count). Module-level `if`, `with`, `try` bodies and class bodies run at import time and count."""
from __future__ import annotations

import ast
import pathlib
from typing import Iterable, Iterator

import deepspeed_c

PACKAGE = "deepspeed_c"
ROOT = pathlib.Path(deepspeed_c.__file__).resolve().parent


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py")) if "__pycache__" not in p.parts}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names)


def _import_time_statements(body: Iterable[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of `body` that run when the module is imported (see the module docstring)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        yield node
        if isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _import_time_statements(node.body)
            yield from _import_time_statements(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _import_time_statements(node.body)
            for handler in node.handlers:
                if not _catches_import_error(handler):
                    yield from _import_time_statements(handler.body)
            yield from _import_time_statements(node.orelse)
            yield from _import_time_statements(node.finalbody)
        elif isinstance(node, (ast.With, ast.ClassDef, ast.For, ast.While)):
            yield from _import_time_statements(node.body)


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _edges(module: str, path: pathlib.Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in _import_time_statements(tree.body):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve_from(module, path.name == "__init__.py", node)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif target in known:
                    out.add(target)
    # importing x.y.z runs the __init__ of each package above it that is not yet imported: any that is not
    # also above `module` (those are initialising already) is entered too
    above_self = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    for target in list(out):
        parts = target.split(".")
        for i in range(2, len(parts)):
            package = ".".join(parts[:i])
            if package in known and package not in above_self:
                out.add(package)
    out.discard(module)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _edges(name, path, known) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm), each
    written as a path A -> ... -> A found inside the component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the package's module count
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(comp, graph) for comp in components]


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from the component's first module back to itself, staying inside the component."""
    members, start = set(component), component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return component


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "deepspeed_c.runtime.engine.engine" in graph
    assert "deepspeed_c.runtime.config" in graph["deepspeed_c.runtime.engine.engine"]


def test_cycle_finder_names_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_relative_imports_resolve():
    node = ast.parse("from ..grad_norm import global_norm").body[0]
    assert _resolve_from("deepspeed_c.runtime.pipe.executor", False, node) == "deepspeed_c.runtime.grad_norm"
    node = ast.parse("from . import executor").body[0]
    assert _resolve_from("deepspeed_c.runtime.pipe", True, node) == "deepspeed_c.runtime.pipe"


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles inside deepspeed_c (break each by moving the shared piece down a layer " \
                       "or importing late, inside the function that needs it):\n" + \
                       "\n".join("  " + " -> ".join(c) for c in cycles)
