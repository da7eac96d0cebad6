"""ZeRO-3 gather-on-use: module hooks that gather a module's parameters before its forward and its
backward and release them after, driven by a fetch plan.

Every module with parameters (its own, registered external ones, or all below it for a z3 leaf module)
is a *step* when its forward starts and again when its backward starts (an identity autograd function
on its outputs); the end of its backward is seen by an identity function on its inputs. The first
iteration runs on demand and records the trace of steps (each step: the units it needs). From the
trace the C fetch planner (ops/fetch_plan.py) computes which units to gather at each step (its own,
and prefetches of the next steps' within stage3_prefetch_bucket_size and stage3_max_live_parameters, issued
in batches of at least half that bucket)
and which to release after it (kept when reused within stage3_max_reuse_distance). Later iterations
follow the plan while their steps match it; the first step that differs (control flow changed, a
layer skipped, a generate-style loop) switches the rest of the iteration back to on demand, and the
newly recorded trace gives the next plan. A unit in use (a module running, GatheredParameters) is
pinned and never released under it. At the end of each backward (and of a forward that will have no
backward) every unit still gathered is released except persistent ones.

Collectives must match across ranks: the plan is a pure function of the trace, and every rank's
trace is checked against rank 0's when a plan is built (an error naming the first module that
differs, instead of mismatched gathers)."""
from __future__ import annotations

import contextlib
import hashlib
from itertools import filterfalse
from typing import Any, Iterator, Optional, Sequence

import torch

from deepspeed_c.runtime import autograd_paths
from deepspeed_c.runtime.zero import linear as zero_linear
from deepspeed_c.runtime.zero.compile_hooks import CompileAwareHooks
from deepspeed_c.runtime.zero.outside_hooks import OutsideCallHooks
from deepspeed_c.runtime.zero.param_store import ParamStore, ZeroParamStatus
from deepspeed_c.runtime.zero.partition_parameters import drop_guard, external_parameters, is_zero_param

_Z3_LEAF_ATTR = "_z3_leaf"
_AVAILABLE = ZeroParamStatus.AVAILABLE
# autograd_paths.transforms_active without its frame, for the module hooks (twice per module call)
_transforms_active = torch._C._are_functorch_transforms_active
PLAN_CACHE = 8  # plans kept for models whose path changes between iterations


def _eager(hook: Any) -> Any:
    """A hook torch.compile never traces: a clean graph break (dynamo would otherwise trace into it up to the
    collective and break there). The root's pair, twice a forward; every other module's hooks are plain until
    dynamo compiles (compile_hooks.py)."""
    return torch.compiler.disable(hook)


def _is_leaf(module: torch.nn.Module) -> bool:
    return bool(getattr(module, _Z3_LEAF_ATTR, False))


class _BackwardMark(torch.autograd.Function):
    """An identity node whose backward tells the coordinator where a module's backward stands."""

    @staticmethod
    def forward(ctx: Any, coord: "ParamCoordinator", key: int, fired: list, *tensors: torch.Tensor) -> Any:
        ctx.coord, ctx.key, ctx.fired = coord, key, fired
        # detached aliases, not the inputs: a Function returning several of its inputs makes them views that
        # refuse in-place updates (the HF Trainer scales a PEFT model's loss with `loss *= ...`)
        return tuple(t.detach() for t in tensors) if len(tensors) > 1 else tensors[0].detach()


# `fired` of one forward of a module: the graph tasks its backward began and ended in. Every backward through
# that forward gathers again (a user's `backward(inputs=[x], retain_graph=True)` or `autograd.grad` before
# the training backward, two losses of one forward each through `engine.backward`); the end pairs with the
# begin of the same backward.
_NONE = -2  # no graph task (torch numbers them from 0, and says -1 outside a backward)


class _PreBackward(_BackwardMark):
    """On a module's outputs: their gradients arrived, its backward starts (gather its units)."""

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        task = torch._C._current_graph_task_id()
        if ctx.fired[0] != task:
            ctx.fired[0], ctx.fired[1] = task, _NONE
            ctx.coord.begin_step(ctx.key, "b")
        return (None, None, None) + grads


class _PostBackward(_BackwardMark):
    """On a module's inputs: their gradients are computed, its backward is over (release its units)."""

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        task = torch._C._current_graph_task_id()
        if ctx.fired[0] == task and ctx.fired[1] != task:
            ctx.fired[1] = task
            ctx.coord.end_step(ctx.key, "b")
        return (None, None, None) + grads


# the marks are applied only inside the module hooks, which dynamo never traces (compile_hooks.py) and which skip
# them under torch.func transforms: torch's Python prelude of Function.apply can go
_PRE_APPLY = autograd_paths.direct_apply(_PreBackward)
_POST_APPLY = autograd_paths.direct_apply(_PostBackward)
_unwrap = autograd_paths.unwrap_if_dead


def _wrap_tensors(apply: Any, coord: "ParamCoordinator", key: int, fired: list, value: Any) -> Any:
    """`value` with its grad-requiring tensors passed through the mark `apply` (one node for all of them)."""
    flat: list[torch.Tensor] = []

    def collect(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            if v.requires_grad:
                flat.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                collect(x)
        elif isinstance(v, dict):
            for x in v.values():
                collect(x)

    collect(value)
    if not flat:
        return value
    out = apply(coord, key, fired, *map(_unwrap, flat))
    new = dict(zip(map(id, flat), out if len(flat) > 1 else (out,)))

    def rebuild(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return new.get(id(v), v)
        if isinstance(v, tuple) and hasattr(v, "_fields"):
            return type(v)(*(rebuild(x) for x in v))
        if isinstance(v, (list, tuple)):
            return type(v)(rebuild(x) for x in v)
        if isinstance(v, dict):  # a fresh output or kwargs (a ModelOutput too): updated in place
            for k in list(v.keys()):
                v[k] = rebuild(v[k])
            return v
        return v

    return rebuild(value)


def mark_leaf_modules(module: torch.nn.Module, spec: Any) -> None:
    """zero_optimization.leaf_module: modules whose class name (or qualified name), module name or name
    suffix is listed are gathered whole, like set_z3_leaf_modules."""
    classes = set(getattr(spec, "classes", []) or [])
    names = set(getattr(spec, "names", []) or [])
    suffixes = tuple(getattr(spec, "name_suffixes", []) or [])
    if not (classes or names or suffixes):
        return
    for name, m in module.named_modules():
        cls = type(m)
        if (cls.__name__ in classes or f"{cls.__module__}.{cls.__qualname__}" in classes or name in names
                or (suffixes and name.endswith(suffixes))):
            setattr(m, _Z3_LEAF_ATTR, True)


class ZeroParamDict(dict):
    """A module's `_parameters` that gathers a partitioned parameter read through the module attribute while
    some module's forward runs (as torch's MultiheadAttention reads its out_proj's weight): the parameter
    joins the running module's step, so later iterations gather it up front."""

    def __init__(self, parameters: dict, coordinator: "ParamCoordinator") -> None:
        super().__init__(parameters)
        self.coordinator = coordinator

    def __getitem__(self, key: str) -> Any:
        p = dict.__getitem__(self, key)
        if p is not None:
            status = getattr(p, "ds_status", None)
            # every read of a module attribute comes here (a Linear's weight and bias at each call): the
            # gathered case is one identity test, the enum's value only for other members
            if status is not None and status is not _AVAILABLE and status.value != 1:
                self.coordinator.fetch_on_access(p)
        return p


zero_linear.PLAIN_READ_DICTS.add(ZeroParamDict)


class ParamCoordinator:
    def __init__(self, module: torch.nn.Module, store: ParamStore, *, prefetch_bucket_size: int,
                 max_live_parameters: int, max_reuse_distance: int, use_plan: bool = True,
                 leaf_modules: Any = None, memory_efficient_linear: bool = True,
                 unit_roots: Sequence[torch.nn.Module] = ()) -> None:
        self.module = module
        self.store = store
        self.limits = dict(prefetch_bucket_size=int(prefetch_bucket_size),
                           max_live_parameters=int(max_live_parameters), max_reuse_distance=int(max_reuse_distance))
        self.use_plan = use_plan
        self.modules: list[torch.nn.Module] = []
        self.names: list[str] = []
        self.units: list[tuple[int, ...]] = []
        self.steady: list[bool] = []  # every unit of the module persistent: no steps, no backward hooks
        self._handles: list[Any] = []
        self._hooks = CompileAwareHooks()
        self._outside = OutsideCallHooks()  # off while their root's forward runs (outside_hooks.py)
        self._hooks.on_compile(self._outside.stop)
        names = {id(m): n for n, m in module.named_modules()}
        if leaf_modules is not None:
            mark_leaf_modules(module, leaf_modules)
        # unit roots (auto_units.py) are gathered whole like leaves; a module inside one that is called while no
        # forward of the model runs gathers its root's unit (_outside_call)
        roots = {id(m) for m in unit_roots if m is not module}
        self._leaf_children: dict[int, Optional[int]] = {}  # module inside a leaf or root -> the root's key
        self._window = 0  # the largest unit of a root: the prefetch window holds at least one
        for m in module.modules():
            if id(m) in self._leaf_children:
                self._inside_unit(m, self._leaf_children[id(m)])
                continue
            whole = _is_leaf(m) or id(m) in roots
            if whole:
                inner = [c for c in m.modules() if c is not m]
                params = list(m.parameters()) + [p for c in inner for p in external_parameters(c)]
            else:
                params = [p for p in m._parameters.values() if p is not None]
            params += external_parameters(m)
            drop_guard(m)
            if any(is_zero_param(p) for p in m._parameters.values()) and type(m._parameters) is dict:
                m.__dict__["_parameters"] = ZeroParamDict(m._parameters, self)
            units = tuple(sorted({getattr(p, "_dsc_z3")[1] for p in params if is_zero_param(p)}))
            if whole:
                root_key = len(self.modules) if units and id(m) in roots else None
                self._leaf_children.update((id(c), root_key) for c in inner)
                if root_key is not None:
                    self._window = max([self._window] + [store.unit_numel[u] for u in units])
            if not units and m is not module:
                # no parameters: no hooks (a parameter it reads through another module's attribute joins
                # the nearest running module with hooks, at worst the root)
                continue
            key = len(self.modules)
            self.modules.append(m)
            self.names.append(names.get(id(m), type(m).__name__) or "<root>")
            self.units.append(units)
            self.steady.append(self._steady(units))
            self._handles.append(self._hooks.register(m, self._pre_hook(key), pre=True, with_kwargs=True))
            self._handles.append(self._hooks.register(m, self._post_hook(key), pre=False, with_kwargs=True))
        self._handles.append(module.register_forward_pre_hook(_eager(self._root_pre), prepend=True))
        self._handles.append(module.register_forward_hook(_eager(self._root_post)))
        # Linear layers save the parameter, not a view of its gathered buffer (linear.py says why)
        self._linears = zero_linear.install(module) if memory_efficient_linear else []
        self._hooks.on_compile(lambda: zero_linear.use_traced(self._linears))
        # A gradient may reach a parameter outside its module's backward: a create_graph penalty's second
        # backward brings d(penalty)/dW to a layer whose forward output the loss never used (the head
        # under an input-gradient penalty), and autograd accumulates into the parameter's shape. Gather its
        # unit just before (a tensor hook runs before AccumulateGrad); the end of the iteration releases it.
        for u, members in enumerate(store.unit_params):
            for p, _ in members:
                if p.requires_grad:
                    self._handles.append(p.register_hook(self._gather_on_grad(u)))
        # the trace being recorded and the plan being followed
        self.trace: list[tuple[int, str]] = []
        self.plan: Any = None
        self.plan_trace: Optional[list[tuple[int, str]]] = None
        self.following = False
        self.step_index = 0
        self._open: dict[int, list[int]] = {}  # key -> stack of step indices of its running steps
        self._running: list[int] = []  # keys of the forwards running now, innermost last
        self._access_pins: dict[int, list[int]] = {}  # key -> units gathered on attribute access in its forward
        # key -> units its recomputed forward (activation checkpointing, inside the backward) keeps gathered and
        # pinned until its backward ends: torch's checkpoint keeps a frozen parameter itself, not a detached
        # alias, among the recomputed tensors and checks their shapes at the first unpack, after the recompute
        # of the whole region: a unit released at the end of its recomputed forward would show its placeholder
        self._held: dict[int, list[int]] = {}
        self.plans_built = 0
        self._plans: dict[tuple, Any] = {}  # trace -> plan, the paths this model has taken lately
        self.off = 0  # hooks_off() depth: every hook passes through

    # -- hooks ---------------------------------------------------------------------------------------
    def _root_pre(self, module: torch.nn.Module, args: Any) -> None:
        if self.off:
            return
        self._hooks.check()
        if not self._in_backward_round():
            self.new_iteration()

    def _root_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.off:
            return
        if not torch.is_grad_enabled() or not _requires_grad(output):
            # no backward will follow this forward: its iteration ends here
            self.end_iteration()

    def _in_backward_round(self) -> bool:
        return torch._C._current_autograd_node() is not None

    def _steady(self, units: Sequence[int]) -> bool:
        return bool(units) and all(self.store.persistent[u] for u in units)

    def _pre_hook(self, key: int) -> Any:
        outside = self._outside.by_root

        def hook(m: torch.nn.Module, args: Any, kwargs: Any) -> Any:
            if self.off:
                return None
            self._running.append(key)
            if key in outside:
                self._outside.detach(key)
            if not self.units[key]:
                return None
            if self.steady[key]:  # persistent units stay gathered until the weights change
                self.store.wait(self.units[key])
                return None
            self.begin_step(key, "f")
            if torch.is_grad_enabled() and not _transforms_active():
                fired = [_NONE, _NONE]
                self.__dict__.setdefault("_fired", {}).setdefault(key, []).append(fired)
                if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
                    if not args[0].requires_grad:
                        return None
                    return (_POST_APPLY(self, key, fired, _unwrap(args[0])),), kwargs
                return _wrap_tensors(_POST_APPLY, self, key, fired, (args, dict(kwargs)))
            return None

        return hook

    def _post_hook(self, key: int) -> Any:
        outside = self._outside.by_root

        def hook(m: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
            if self.off:
                return None
            if key in outside:
                self._outside.attach(key)
            if self._running and self._running[-1] == key:
                self._running.pop()
            if not self.units[key]:
                return None
            if self.steady[key]:
                if key in self._access_pins:
                    self.end_step(key, "f")
                return None
            # also drops the units its attribute reads gathered; a recompute holds its own until the backward
            self.end_step(key, "f", hold=self._in_backward_round())
            # under torch.func the transform differentiates functionally (no autograd backward to mark)
            if torch.is_grad_enabled() and not _transforms_active():
                stack = self.__dict__.setdefault("_fired", {}).setdefault(key, [])  # key -> stack of its forwards' fired lists
                fired = stack.pop() if stack else [_NONE, _NONE]
                if isinstance(output, torch.Tensor):
                    return _PRE_APPLY(self, key, fired, _unwrap(output)) if output.requires_grad else None
                return _wrap_tensors(_PRE_APPLY, self, key, fired, output)
            return None

        return hook

    def _gather_on_grad(self, u: int) -> Any:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if not self.store.ready[u]:
                self.store.wait([u])
            return grad

        return hook

    def _inside_unit(self, m: torch.nn.Module, root_key: Optional[int]) -> None:
        """A module inside a leaf or unit root: no gather steps of its own. Its parameters gather on attribute
        access inside another module's forward (ZeroParamDict); inside a unit root, a call outside the root's
        forward (the parent calling it past the root, the user calling it directly) gathers the root's unit."""
        if any(is_zero_param(p) for p in m._parameters.values()) and type(m._parameters) is dict:
            m.__dict__["_parameters"] = ZeroParamDict(m._parameters, self)
        if root_key is not None and any(True for _ in m.parameters()):
            drop_guard(m)  # zero.Init's refusal of a call with partitioned parameters: this gathers instead
            handle = self._hooks.register(m, self._outside_call(root_key), pre=True, with_kwargs=True)
            self._handles.append(handle)
            self._outside.add(root_key, handle)

    def _outside_call(self, key: int) -> Any:
        """Pre-hook of a module inside unit root `key`: inside the root's forward it does nothing (the root has
        gathered its unit); outside it, the call is a step of the root (its whole unit gathered for the call and
        for its backward, released after them, not pinned for the whole forward of whatever module runs),
        ended by a one-shot post-hook."""
        pre, post = self._pre_hook(key), self._post_hook(key)

        def hook(m: torch.nn.Module, args: Any, kwargs: Any) -> Any:
            if self.off or key in self._running:
                return None
            once: list = []

            def after(m: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
                once.pop().remove()
                return post(m, args, kwargs, output)

            once.append(m.register_forward_hook(self._hooks.wrap(after), with_kwargs=True, always_call=True))
            return pre(m, args, kwargs)

        return hook

    # -- steps ---------------------------------------------------------------------------------------
    def begin_step(self, key: int, phase: str) -> None:
        i = self.step_index
        self.step_index += 1
        self.trace.append((key, phase))
        store = self.store
        if self.following:
            assert self.plan_trace is not None
            if not (i < len(self.plan_trace) and self.plan_trace[i] == (key, phase)):
                self._switch_plan(i)
        units = self.units[key]
        if store.early:  # gathered ahead by the optimizer step: the plan's from here on
            store.take_early()
        if not self.following and store.world_size > 1:
            self._check_same_step(i, key, phase, units)
        # _make_room's "already fits" case inlined (once per module step): _missing's sum without its frames
        full, persistent, unit_numel = store.full, store.persistent, store.unit_numel
        missing = 0
        for u in units:
            if full[u] is None and not persistent[u]:
                missing += unit_numel[u]
        if store.live_numel + missing > self.limits["max_live_parameters"]:
            self._make_room(units)
        if self.following:
            for n, group in enumerate(self.plan.fetch_at(i)):
                if n == 0:  # the step's own units first: also any the plan kept but _make_room released
                    store.fetch(units, lossy=True)
                elif self._fits(group):  # a prefetch never pushes past the live limit
                    store.fetch(group, lossy=True)
        store.wait(units, lossy=True)  # gather-on-use: ZeRO++ may quantize or gather from hpZ's secondary
        for u in units:
            store.pins[u] += 1
        self._open.setdefault(key, []).append((i, units))

    def _missing(self, units: Sequence[int]) -> int:
        # begin_step repeats this sum inline: change both
        store = self.store
        return sum(store.unit_numel[u] for u in units if not store.is_live(u) and not store.persistent[u])

    def _fits(self, units: Sequence[int]) -> bool:
        return self.store.live_numel + self._missing(units) <= self.limits["max_live_parameters"]

    def _make_room(self, units: Sequence[int]) -> None:
        """Releases gathered units nobody is using (prefetched or kept for reuse) when gathering this step's
        would pass stage3_max_live_parameters: the limit holds whenever the running modules allow it."""
        if self._fits(units):
            return
        store = self.store
        mine = set(units)
        for u in range(len(store.full)):
            if store.is_live(u) and store.pins[u] == 0 and not store.persistent[u] and u not in mine:
                store.release([u])
                if self._fits(units):
                    return

    def _switch_plan(self, i: int) -> None:
        """The model left the plan at step i: follow a cached plan whose trace starts the same way, else go on
        on demand (first dropping what the old plan prefetched, so the live limit holds)."""
        prefix = tuple(self.trace)
        for trace, plan in reversed(list(self._plans.items())):
            if trace[:i + 1] == prefix:
                self.plan, self.plan_trace = plan, list(trace)
                return
        self.following = False
        self.store.release([u for u in range(len(self.store.full)) if not self.store.persistent[u]])

    def end_step(self, key: int, phase: str, hold: bool = False) -> None:
        store = self.store
        extra = self._access_pins.pop(key, ()) if phase == "f" else ()
        for u in extra:
            store.pins[u] -= 1
        held = self._held.pop(key, []) if phase == "b" else []
        for u in held:
            store.pins[u] -= 1
        stack = self._open.get(key)
        if not stack:
            store.release([u for u in set(extra) | set(held) if not store.persistent[u]])
            return
        i, units = stack.pop()
        if hold:  # pinned units are skipped by every release below until the backward drops the pin
            self._held.setdefault(key, []).extend(units)
        else:
            for u in units:
                store.pins[u] -= 1
        if self.following:  # once per module step: filterfalse, no comprehension frame
            store.release(list(filterfalse(store.persistent.__getitem__, set(self.plan.release_at(i)) | set(held))))
        else:
            store.release([u for u in set(units) | set(extra) | set(held) if not store.persistent[u]])

    def fetch_on_access(self, p: torch.nn.Parameter) -> None:
        if not self._running:
            return  # outside a forward a placeholder is what DeepSpeed returns too
        key = self._running[-1]
        u = getattr(p, "_dsc_z3")[1]
        if u not in self.units[key]:
            self.units[key] = tuple(sorted(self.units[key] + (u,)))
            self.steady[key] = self._steady(self.units[key])
            self._plans.clear()  # their steps lack this unit
        self.store.wait([u], lossy=True)
        self.store.pins[u] += 1  # until the end of this forward
        self._access_pins.setdefault(key, []).append(u)

    # -- iterations ----------------------------------------------------------------------------------
    def new_iteration(self) -> None:
        if self.trace:
            self.end_iteration()
        self.step_index = 0
        self.following = self.plan is not None

    def end_iteration(self) -> None:
        """Everything still gathered is released (persistent units stay); the trace becomes the plan."""
        self._open.clear()
        self._running.clear()
        self._outside.attach_all()  # any a forward that raised left off
        self._access_pins.clear()
        self._held.clear()  # unpin_all below drops their pins
        self.__dict__.pop("_fired", None)
        self.store.unpin_all()
        self.store.release_all(keep_persistent=True)
        trace, self.trace = self.trace, []
        self.step_index = 0
        self.following = False
        if not trace or not self.use_plan or trace == self.plan_trace:
            return
        key = tuple(trace)
        plan = self._plans.pop(key, None)
        if plan is None:
            self._check_same_trace(trace)
            plan = self._build_plan(trace)
            while len(self._plans) >= PLAN_CACHE:
                self._plans.pop(next(iter(self._plans)))
        self._plans[key] = plan  # most recently used last
        self.plan, self.plan_trace = plan, trace

    def _build_plan(self, trace: Sequence[tuple[int, str]]) -> Any:
        from deepspeed_c.ops.fetch_plan import FetchPlan

        self.plans_built += 1
        # prefetches go out in batches of at least half a bucket: a per-module model otherwise prefetches one
        # unit per step, and each gather is a sync point of every rank (1.3B on 4 H100s: forward 81 -> 68 ms;
        # 0.75 or a whole bucket gave no more on 2 H200s)
        # a unit root larger than the bucket is still prefetched, alone (DeepSpeed's prefetcher admits a first
        # parameter over the bucket too): the window is at least one such unit deep
        limits = dict(self.limits, prefetch_bucket_size=max(self.limits["prefetch_bucket_size"], self._window)
                      if self.limits["prefetch_bucket_size"] > 0 else 0)
        return FetchPlan.build([list(self.units[k]) for k, _ in trace], self.store.unit_numel,
                               self.store.persistent, min_prefetch_batch=self.limits["prefetch_bucket_size"] // 2,
                               **limits)

    def _check_same_trace(self, trace: Sequence[tuple[int, str]]) -> None:
        if self.store.world_size == 1:
            return
        import deepspeed_c.comm as dist

        digest = hashlib.sha1(repr(list(trace)).encode()).digest()[:8]
        mine = torch.tensor(list(digest), dtype=torch.uint8, device=self.store.compute_device)
        every = [torch.empty_like(mine) for _ in range(self.store.world_size)]
        dist.all_gather(every, mine, group=self.store.group, log_name="zero3_trace_check")
        if all(torch.equal(e, mine) for e in every):
            return
        traces: list[Any] = [None] * self.store.world_size
        dist.all_gather_object(traces, list(trace), group=self.store.group, log_name="zero3_trace_check")
        ref = traces[0]
        k = next((k for k in range(min(len(ref), len(trace))) if ref[k] != trace[k]), min(len(ref), len(trace)))
        mine_s = self._describe(trace, k)
        theirs = self._describe(ref, k)
        raise RuntimeError(f"ZeRO-3: the ranks ran different modules (step {k} of the iteration: this rank ran "
                           f"{mine_s}, rank 0 ran {theirs}); every rank must run the same modules in the same order "
                           "so that their parameter gathers match")

    def _check_same_step(self, i: int, key: int, phase: str, units: Sequence[int]) -> None:
        """On demand (recording a trace) every step's gathers are checked against every rank's first: ranks
        that run different modules get an error naming them instead of mismatched collectives."""
        # deepspeed_c.comm: logged apart from the unit gathers; with the logger off, the prebuilt call (comm/direct.py)
        import deepspeed_c.comm as dist

        mine = torch.tensor([i, key, 0 if phase == "f" else 1, len(units), sum(units)], dtype=torch.int64,
                            device=self.store.compute_device)
        every = torch.empty(self.store.world_size * mine.numel(), dtype=torch.int64, device=mine.device)
        dist.all_gather_into_tensor(every, mine, group=self.store.group, log_name="zero3_step_check")
        rows = every.view(self.store.world_size, -1).tolist()
        odd = [r for r, row in enumerate(rows) if row != rows[0]]
        if not odd:
            return

        def name(row: list[int]) -> str:
            return f"the {'forward' if row[2] == 0 else 'backward'} of module '{self.names[row[1]]}'"
        raise RuntimeError(f"ZeRO-3: the ranks ran different modules at step {i} of the iteration: rank 0 ran "
                           f"{name(rows[0])}, rank {odd[0]} ran {name(rows[odd[0]])}; every rank must run the same "
                           "modules in the same order so that their parameter gathers match")

    def _describe(self, trace: Sequence[tuple[int, str]], k: int) -> str:
        if k >= len(trace):
            return "nothing (its iteration ended)"
        key, phase = trace[k]
        return f"the {'forward' if phase == 'f' else 'backward'} of module '{self.names[key]}'"

    @contextlib.contextmanager
    def hooks_off(self) -> Iterator[None]:
        """Every hook passes through in the body (unwrap_model_for_generation; DeepSpeed removes them): the
        caller has gathered and pinned every unit, and a forward without backward would otherwise end an
        iteration and release everything, pins included."""
        if self._running:
            raise RuntimeError("ZeRO-3: unwrap_model_for_generation inside a forward of the model")
        self.off += 1
        try:
            yield
        finally:
            self.off -= 1

    def invalidate(self) -> None:
        """The weights changed (an optimizer step, a load): every gathered copy is stale."""
        self.store.release_all(keep_persistent=False)

    def remove(self) -> None:
        self._outside.stop()  # before the handles go: it puts back what it took off
        for h in self._handles:
            h.remove()
        self._handles = []
        zero_linear.uninstall(self._linears)
        self._linears = []
        for m in self.modules:
            if type(m._parameters) is ZeroParamDict:
                m.__dict__["_parameters"] = dict(m._parameters)


def _requires_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(_requires_grad(v) for v in value)
    if isinstance(value, dict):
        return any(_requires_grad(v) for v in value.values())
    return hasattr(value, "__dataclass_fields__") and any(
        _requires_grad(getattr(value, f)) for f in value.__dataclass_fields__)
