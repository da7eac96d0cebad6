"""The pipeline executor (runtime/pipe/executor.py) works on the narrow inputs the PipelineEngine builds
for it (module, grid, precision policy, backward state, stepper, PipeOptions, callables), never on the
engine: no function of its takes an `engine` argument, it keeps no `.e` handle, reads or writes no
`_private` attribute of another object, and assigns to no attribute but its own (`self.x = ...`)."""
from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[2] / "deepspeed_c" / "runtime" / "pipe" / "executor.py"


def _tree() -> ast.Module:
    return ast.parse(SRC.read_text())


def test_executor_takes_no_engine() -> None:
    for node in ast.walk(_tree()):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = [a.arg for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs]
            assert "engine" not in args and "e" not in args, f"executor.py: {node.name}() takes the engine"


def test_executor_touches_no_private_attribute_of_another_object() -> None:
    for node in ast.walk(_tree()):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        assert not (isinstance(base, ast.Attribute) and base.attr == "e"
                    and isinstance(base.value, ast.Name) and base.value.id == "self"), \
            f"executor.py:{node.lineno} reads self.e"
        if isinstance(base, ast.Name) and base.id in ("e", "engine"):
            raise AssertionError(f"executor.py:{node.lineno} reads {base.id}.{node.attr}")
        if node.attr.startswith("_") and not node.attr.startswith("__"):
            # its own private methods and fields only (self._x), torch._foreach_*; torch's p._backward_hooks is the one read of
            # a library tensor's field (autograd's hook dict, which decides the two-traversal path)
            own = isinstance(base, ast.Name) and base.id in ("self", "torch")  # torch's multi-tensor ops
            assert own or node.attr == "_backward_hooks", f"executor.py:{node.lineno} reads .{node.attr}"


def test_executor_assigns_only_its_own_fields() -> None:
    for node in ast.walk(_tree()):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                    own = isinstance(sub.value, ast.Name) and sub.value.id == "self"
                    # _reduce_tied gives a tied weight with no gradient a zero one, as the reducer would
                    assert own or sub.attr == "grad", f"executor.py:{sub.lineno} assigns .{sub.attr} of another object"
