"""Collaborators own their state (issue 37): code in deepspeed_c/runtime/ neither writes another object's
attributes nor reads another class's `_private` ones. An AST walk over runtime/**.py fails on

  (a) `x.attr = ...`, `x.attr += ...`, `del x.attr`, `setattr(x, ...)`, `delattr(x, ...)` where x is not
      `self` / `cls`, and
  (b) `x._private` (one leading underscore, not a dunder) or `getattr/hasattr(x, "_private")` where x is
      not `self` / `cls` / `super()` / a module the file imports (`torch._C._foo` is torch's business),

unless one of the small named rules below applies. Each rule is a kind of object or a protocol, never a
line: a reach the rules do not cover is fixed in the code (a constructor argument, a method of the owner,
a public accessor), not listed here."""
from __future__ import annotations

import ast
import functools
import importlib.util
import pathlib
from typing import Iterator, Optional

RUNTIME = pathlib.Path(__file__).resolve().parents[2] / "deepspeed_c" / "runtime"


# -- (a) writes -------------------------------------------------------------------------------------------
# torch's tensor API: a gradient or a storage swap is set on the tensor (p.grad = ..., p.data = ...).
TENSOR_API = {"grad", "data"}
# DeepSpeed's per-parameter protocol: zero.Init / the partitioner / the pipeline attach these to every
# parameter (ds_id, ds_status, ds_tensor, ds_pipe_replicated, all_gather(), partition(), ...) and every part
# of DeepSpeed (and client code) reads them; `comm_dtype` is torch_autocast's per-parameter communication
# dtype, `use_muon` deepspeed.set_optimizer_flags' Muon flag; `_dsc_*` are deepspeed_c's own per-parameter
# tags of the same protocol, kept off DeepSpeed's names.
PARAM_PROTOCOL_PREFIXES = ("ds_", "_dsc_")
# (`comm`: MiCS's per-parameter groups, DeepSpeed's MiCS_Init sets param.comm)
PARAM_PROTOCOL = {"all_gather", "all_gather_coalesced", "partition", "partition_numel", "comm_dtype", "use_muon",
                  "comm"}
# Public DeepSpeed protocol attributes set across objects, as DeepSpeed sets them:
PROTOCOL_ATTRS = {
    # the engine tells its optimizer (a client's too) whether this micro-step ends accumulation
    "is_gradient_accumulation_boundary",
    # the 1-bit optimizers switch the engine's own gradient all-reduce off once compression starts
    "enable_backward_allreduce", "pipeline_enable_backward_allreduce",
    # deepspeed.initialize / the engine write the resolved launcher values into the user's argparse args
    "local_rank", "deepspeed_config", "deepscale_config",
    # DeepSpeed's ZeRO-3 leaf-module flag (deepspeed.utils.set_z3_leaf_modules sets it on the module)
    "_z3_leaf",
}
# torch.optim.Optimizer's public fields: the MoE group split replaces the user's optimizer's param_groups as
# DeepSpeed's split_params_into_different_moe_groups_for_optimizer use does.
TORCH_OPTIMIZER_FIELDS = {"param_groups", "state"}
# A module's forward replaced on one nn.Module instance by `m.forward = types.MethodType(fn, m)`: nn.Module
# calls self.forward, so an instance attribute is the supported per-instance override (hooks and the class
# stay as they are); the installers check they replace only torch's own forward.
FORWARD_OVERRIDE = "forward"
# The ctx torch hands a torch.autograd.Function's static forward/backward is there to carry its state.
AUTOGRAD_METHODS = {"forward", "backward", "setup_context", "jvp", "vjp"}
# Also allowed, by kind (see _Scan._write_allowed): dunders (Python's data model: a function's __name__, a
# class's __module__, a scoped patch of a third-party class's __call__ / __init_subclass__ that is put back);
# the holder's own dataclass record (_record_fields); a module's own private global (a threading.local); an
# object the function is constructing (_Scan._fresh); the config parsers' section records (config/ only).

# -- (b) private reads ------------------------------------------------------------------------------------
# torch's own internals DeepSpeed's algorithms are defined over (no public equivalent exists): a module's
# parameter/buffer/submodule dicts (ZeRO-3 swaps a module's parameters), a parameter's hook dicts (the
# reducers see whether a hook is already there), a tensor's version counter (the 1-bit error feedback checks
# a moment was not changed in place), and ProcessGroup's flat all-gather.
# ProcessGroup options keep the group's timeout only as `_timeout` (the pipeline's receive timeout).
TORCH_INTERNALS = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_backward_hooks",
                   "_post_accumulate_grad_hooks", "_version", "_allgather_base", "_timeout",
                   "_cdata"}  # a storage's handle, what torch._C's own functions (_storage_Use_Count) take
# Other frameworks' attributes with a leading underscore that are their de facto public protocol:
FOREIGN_PROTOCOL = {
    # DeepSpeed's engine reads a client optimizer's last gradient norm from `_global_grad_norm`
    "_global_grad_norm",
    # transformers' PretrainedConfig names the attention backend in `_attn_implementation` (Ulysses wraps it)
    "_attn_implementation",
}
# namedtuple's public API is underscore-prefixed so it cannot clash with field names.
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not _is_dunder(name)


@functools.lru_cache(maxsize=None)
def _is_module(dotted: str) -> bool:
    """`from pkg import name` binds a module (deepspeed_c.utils.groups, torch.distributed) rather than a class."""
    try:
        return importlib.util.find_spec(dotted) is not None
    except (ImportError, ValueError, AttributeError):
        return False


def _files() -> list[tuple[str, ast.Module]]:
    files = sorted(RUNTIME.rglob("*.py"))
    assert files, RUNTIME
    return [(p.relative_to(RUNTIME).as_posix(), ast.parse(p.read_text(), filename=str(p))) for p in files]


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _dataclasses(trees: list[tuple[str, ast.Module]]) -> set[str]:
    names = set()
    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for d in node.decorator_list:
                    d = d.func if isinstance(d, ast.Call) else d
                    if ast.unparse(d) in ("dataclass", "dataclasses.dataclass"):
                        names.add(node.name)
    return names


def _record_fields(trees: list[tuple[str, ast.Module]], records: set[str]) -> set[str]:
    """Fields `F` that every `self.F = <call>` in runtime/ binds to a new dataclass record: the holder's own
    plain record (`self.stats`, `self.train_state`). A record has no behaviour to bypass, its public fields are
    its interface, and its holder updates them (self.stats.steps += 1)."""
    kinds: dict[str, set[bool]] = {}
    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        kinds.setdefault(t.attr, set()).add(_callee(node.value) in records)
    return {f for f, k in kinds.items() if k == {True}}


class _Scan(ast.NodeVisitor):
    def __init__(self, rel: str, tree: ast.Module, record_fields: set[str], constants: dict[str, str]) -> None:
        self.rel, self.record_fields, self.constants = rel, record_fields, constants
        self.modules: set[str] = set()  # names the file's imports bind to modules (never to classes)
        self.module_globals: set[str] = set()
        package = ".".join(["deepspeed_c", "runtime", *rel.split("/")[:-1]])
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                self.modules.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base]).strip(".")
                self.modules.update(a.asname or a.name for a in node.names if _is_module(f"{base}.{a.name}"))
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Name):
                        self.module_globals.add(t.id)
        self.classes: list[ast.ClassDef] = []
        self.funcs: list[ast.AST] = []
        self.writes: list[str] = []
        self.reads: list[str] = []

    # -- context ---------------------------------------------------------------------------------------------
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node)
        self.generic_visit(node)
        self.classes.pop()

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.funcs.append(node)
        self.generic_visit(node)
        self.funcs.pop()

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def _func(self) -> Optional[ast.AST]:
        return self.funcs[-1] if self.funcs else None

    def _first_arg(self, fn: ast.AST) -> Optional[str]:
        args = fn.args.posonlyargs + fn.args.args
        return args[0].arg if args else None

    def _decorators(self, fn: ast.AST) -> set[str]:
        return {ast.unparse(d) for d in getattr(fn, "decorator_list", [])}

    # -- the rules -------------------------------------------------------------------------------------------
    def _own(self, base: ast.AST) -> bool:
        """self / cls, super(), and the instance a method of the class has just created."""
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            return True
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
            return True
        return isinstance(base, ast.Name) and self._fresh(base.id)

    def _fresh(self, name: str) -> bool:
        """`name` is bound in this function to an object the code is constructing and nobody else holds yet:
        `x = cls(...)` in a classmethod or `x = TheEnclosingClass(...)` (the class's own code on its own new
        instance), or `x = object.__new__(...)` (a function assembling a new object field by field)."""
        fn = self._func()
        if fn is None or isinstance(fn, ast.Lambda):
            return False
        owners = set()
        if "classmethod" in self._decorators(fn) and self._first_arg(fn):
            owners.add(self._first_arg(fn))
        if self.classes:
            owners.add(self.classes[-1].name)
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                    any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                f = node.value.func
                if isinstance(f, ast.Name) and f.id in owners:
                    return True
                if ast.unparse(f) == "object.__new__":
                    return True
        return False

    def _autograd_ctx(self, base: ast.AST) -> bool:
        """The ctx of a torch.autograd.Function's forward/backward: torch hands it over to carry state."""
        fn = self._func()
        if fn is None or not self.classes or not isinstance(base, ast.Name):
            return False
        if getattr(fn, "name", None) not in AUTOGRAD_METHODS or "staticmethod" not in self._decorators(fn):
            return False
        if not any(ast.unparse(b).endswith("Function") for b in self.classes[-1].bases):
            return False
        return self._first_arg(fn) == base.id

    def _write_allowed(self, base: ast.AST, attr: str, value: Optional[ast.AST]) -> bool:
        if self._own(base) or self._autograd_ctx(base) or _is_dunder(attr):
            return True  # dunders: Python's data model (a function's __name__, a scoped patch of a class's hook)
        if attr in TENSOR_API or attr in PARAM_PROTOCOL or attr.startswith(PARAM_PROTOCOL_PREFIXES):
            return True
        if attr in PROTOCOL_ATTRS or attr in TORCH_OPTIMIZER_FIELDS:
            return True
        if attr == FORWARD_OVERRIDE and isinstance(value, ast.Call) and ast.unparse(value.func) == "types.MethodType":
            return True
        if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id == "self" and \
                base.attr in self.record_fields and not _is_private(attr):
            return True  # the holder's own dataclass record (see _record_fields)
        if isinstance(base, ast.Name) and base.id in self.module_globals and _is_private(base.id):
            return True  # this module's own private global (a threading.local, a cache): the module's state
        # the config package normalising the section records it is building while it parses the JSON (a
        # parser's parameter or local); DeepSpeedConfig itself changes after construction only through its
        # own setters (set_batch_sizes, set_gradient_clipping)
        return self.rel.startswith("config/") and isinstance(base, ast.Name)

    def _read_allowed(self, base: ast.AST, attr: str) -> bool:
        if self._own(base) or attr in TORCH_INTERNALS or attr in NAMEDTUPLE_API or attr in FOREIGN_PROTOCOL:
            return True
        if attr.startswith(PARAM_PROTOCOL_PREFIXES) or attr in PROTOCOL_ATTRS:
            return True  # the per-parameter / per-module protocol tags above
        root = base  # torch._C._foo, dist.distributed_c10d._bar: a library's own API, through its module
        while isinstance(root, ast.Attribute):
            root = root.value
        return isinstance(root, ast.Name) and root.id in self.modules

    # -- the walk --------------------------------------------------------------------------------------------
    def _where(self, node: ast.AST, text: str) -> str:
        return f"{self.rel}:{node.lineno}: {text}"

    def _targets(self, node: ast.AST) -> Iterator[ast.Attribute]:
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                    yield sub

    def _check_writes(self, node: ast.AST) -> None:
        value = getattr(node, "value", None)
        for t in self._targets(node):
            if not self._write_allowed(t.value, t.attr, value):
                self.writes.append(self._where(t, ast.unparse(t)))

    def visit_Assign(self, node: ast.AST) -> None:
        self._check_writes(node)
        self.generic_visit(node)

    visit_AugAssign = visit_AnnAssign = visit_Delete = visit_For = visit_AsyncFor = visit_Assign

    def visit_withitem(self, node: ast.withitem) -> None:
        if isinstance(node.optional_vars, ast.Attribute):
            t = node.optional_vars
            if not self._write_allowed(t.value, t.attr, None):
                self.writes.append(self._where(t, ast.unparse(t)))
        self.generic_visit(node)

    def _const_name(self, node: ast.AST) -> str:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else "<dynamic>"

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if isinstance(f, ast.Name) and len(node.args) >= 2:
            target, name = node.args[0], node.args[1]
            attr = self.constants.get(name.id, "<dynamic>") if isinstance(name, ast.Name) else self._const_name(name)
            if f.id in ("setattr", "delattr") and not self._write_allowed(target, attr, None):
                self.writes.append(self._where(node, ast.unparse(node)))
            if f.id in ("getattr", "hasattr") and _is_private(attr) and not self._read_allowed(target, attr):
                self.reads.append(self._where(node, ast.unparse(node)))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if _is_private(node.attr) and not self._read_allowed(node.value, node.attr):
            self.reads.append(self._where(node, ast.unparse(node)))
        self.generic_visit(node)


def _string_constants(trees: list[tuple[str, ast.Module]]) -> dict[str, str]:
    """Module-level NAME = "attr" constants, so setattr(p, UNIT_ATTR, ...) is judged by the attribute name."""
    out = {}
    for _, tree in trees:
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                    isinstance(node.value.value, str):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = node.value.value
    return out


def _scan_trees(trees: list[tuple[str, ast.Module]]) -> tuple[list[str], list[str]]:
    constants = _string_constants(trees)
    fields = _record_fields(trees, _dataclasses(trees))
    writes, reads = [], []
    for rel, tree in trees:
        scan = _Scan(rel, tree, fields, constants)
        scan.visit(tree)
        writes += scan.writes
        reads += scan.reads
    return writes, reads


@functools.lru_cache(maxsize=1)
def _scan() -> tuple[list[str], list[str]]:
    return _scan_trees(_files())


def test_no_writes_to_another_objects_attributes() -> None:
    writes, _ = _scan()
    assert not writes, "runtime/ writes another object's attributes:\n" + "\n".join(writes)


def test_no_reads_of_another_classes_private_attributes() -> None:
    _, reads = _scan()
    assert not reads, "runtime/ reads another class's _private attributes:\n" + "\n".join(reads)


_SAMPLE = '''
import torch
from dataclasses import dataclass


@dataclass
class Stats:
    steps: int = 0


class Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.saved = x                     # allowed: autograd's ctx
        return x


class Owner:
    def __init__(self, other):
        self.stats = Stats()
        self.other = other

    @classmethod
    def build(cls):
        made = cls(None)
        made._ready = True                # allowed: the class's own new instance
        return made

    def run(self, p, m):
        self.stats.steps += 1             # allowed: its own dataclass record
        p.grad = None                     # allowed: torch's tensor API
        p.ds_status = 1                   # allowed: DeepSpeed's per-parameter protocol
        n = len(m._parameters) + torch._C._get_tracing_state() is None   # allowed: torch internals
        self.other.value = n              # a reach: another object's attribute
        setattr(self.other, "mode", 1)    # a reach
        self.stats._hidden = 2            # a reach: a record's private field
        return self.other._cache, getattr(p, "_secret", None)   # two private reads
'''


def test_the_walk_finds_reaches_and_keeps_the_named_rules() -> None:
    """The rules are not vacuous: a sample with one of each allowed kind and five reaches."""
    writes, reads = _scan_trees([("sample.py", ast.parse(_SAMPLE))])
    assert [w.split(": ", 1)[1] for w in writes] == [
        "self.other.value", "setattr(self.other, 'mode', 1)", "self.stats._hidden"], writes
    assert [r.split(": ", 1)[1] for r in reads] == [
        "self.stats._hidden", "self.other._cache", "getattr(p, '_secret', None)"], reads
