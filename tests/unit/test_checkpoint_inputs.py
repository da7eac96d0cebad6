"""The checkpointers work on the states and options the engine hands them (CheckpointStates,
CheckpointOptions), never on the engine: no function of theirs takes an `engine` argument, and none
reads the config's raw dict or another object's `_config`."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "deepspeed_c" / "runtime"
FILES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "checkpointing").glob("*.py"))
ALLOWED: set[tuple[str, str]] = set()  # (file, function) pairs exempt from the walk: none


@pytest.mark.parametrize("name", FILES)
def test_checkpointer_takes_no_engine(name: str) -> None:
    tree = ast.parse((ROOT / name).read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (name, node.name) not in ALLOWED:
            args = [a.arg for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs]
            assert "engine" not in args, f"{name}: {node.name}() takes the engine"
        if isinstance(node, ast.Attribute):
            assert node.attr not in ("_config", "_param_dict"), f"{name}:{node.lineno} reads .{node.attr}"
