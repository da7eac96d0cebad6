"""Collaborators get what they use, never the engine (issue 37): no function of deepspeed_c outside
runtime/engine/ takes a parameter named `engine`. The engine's own package may (it builds its
collaborators there: zero_setup.py, profile_setup.py); everything else receives options, the module,
the optimizer, process groups and callables."""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "deepspeed_c"
ENGINE_PACKAGE = "runtime/engine/"
# Files exempt from the walk: none. runtime/pipe/executor.py (the pipeline instruction executor, owned by another
# change) was to be exempt while it still drove the PipelineEngine it was handed; since bd2ac0d it takes narrow
# inputs built by PipelineEngine._build_executor, so it is walked like every other file.
# runtime/rollout/hybrid_engine_rollout.py is not a collaborator but a client of the engine, as a user's trainer is:
# DeepSpeed's public signature is HybridEngineRollout(engine, tokenizer, cfg=None) (build_rollout passes engine=),
# it keeps `rollout.engine`, and it only calls the engine's public face (engine.module.generate).
ALLOWED_FILES: set[str] = {"runtime/rollout/hybrid_engine_rollout.py"}


def _takes_engine(node: ast.AST) -> bool:
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return "engine" in names


def test_no_function_outside_the_engine_takes_the_engine() -> None:
    offenders = []
    files = sorted(PACKAGE.rglob("*.py"))
    assert files, PACKAGE
    for path in files:
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(ENGINE_PACKAGE) or rel in ALLOWED_FILES:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and _takes_engine(node):
                offenders.append(f"{rel}:{node.lineno} {getattr(node, 'name', '<lambda>')}()")
    assert not offenders, "functions outside runtime/engine/ that take the engine:\n" + "\n".join(offenders)

