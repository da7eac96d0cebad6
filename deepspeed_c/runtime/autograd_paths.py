"""When a fast path may change how a gradient reaches `.grad`: the one rule every such path asks.

The engine's fast paths (ZeRO-1/2 Linear weight gradients written in place into the reduction bucket, the
accumulation-scaling hooks of a direct `loss.backward()`, the engine's backward prologue on the model's
outputs, ZeRO-3's memory-efficient Linear) are only right in a backward that will add into the parameter's
`.grad`: `loss.backward()`, `engine.backward(loss)`, `backward(inputs=[...that parameter...])`. Users also
run autograd for other ends between steps (adversarial inputs, saliency, GradNorm, MAML, gradient
penalties, per-sample gradients) and there the gradient must be plain autograd's, returned to them and
never reduced, scaled or written into a bucket.

torch says whether the running graph task will execute a node (`torch._C._will_engine_execute_node`, which
`torch.utils.checkpoint` uses too): a parameter's gradient is accumulated exactly when its AccumulateGrad
node executes. `autograd.grad` never executes AccumulateGrad (torch refuses the question for a leaf it
captures, which means the same), `backward(inputs=[x])` executes only the listed leaves' nodes. Under
`create_graph` (grad mode on inside the backward) the gradient must stay differentiable, so in-place
writes step aside too; under torch.func transforms (vmap, grad, jacrev) the custom autograd Functions of
the fast paths do not run at all (functorch would need a vmap rule for each)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.autograd.graph import get_gradient_edge


def transforms_active() -> bool:
    """A torch.func transform (vmap, grad, jacrev, ...) is running: use torch's own ops, no custom Functions."""
    return torch._C._are_functorch_transforms_active()


def direct_apply(function: type) -> Callable[..., Any]:
    """`function.apply` without torch's Python prelude (setup_context's argument binding, the torch.func dispatch,
    a generator unwrapping dead functorch wrappers: seven Python calls an apply, for hooks that run hundreds of
    times a step). Only for a Function without setup_context, called where no torch.func transform is active and
    dynamo is not tracing (it knows `apply`, not this), with each tensor argument passed through
    `unwrap_if_dead` as torch's prelude does."""
    if function.setup_context is not torch.autograd.function._SingleLevelFunction.setup_context:
        raise TypeError(f"direct_apply: {function.__name__} defines setup_context; use its apply")
    return torch._C._FunctionBase.__dict__["apply"].__get__(None, function)


unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def will_execute(node: Any) -> bool:
    """The running backward will execute `node` (False outside a backward, and for a leaf's AccumulateGrad
    under `autograd.grad`, which captures its gradient instead)."""
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False


def accumulates_in_place(node: Any) -> bool:
    """A fast path that writes or moves gradients outside autograd may act on the gradient that flows into
    `node` (a parameter's AccumulateGrad): this backward accumulates into `.grad` and does not build a graph."""
    return not torch.is_grad_enabled() and will_execute(node)


def param_accumulates(param: torch.Tensor) -> bool:
    """The running backward will add into `param.grad` (create_graph or not)."""
    if not param.requires_grad:
        return False
    return will_execute(get_gradient_edge(param).node)


def any_accumulates(params: Iterable[torch.Tensor]) -> bool:
    """The running backward adds into the `.grad` of at least one of `params`."""
    for p in params:
        if not p.requires_grad:
            continue
        try:
            if torch._C._will_engine_execute_node(get_gradient_edge(p).node):
                return True
        except RuntimeError:
            return False  # autograd.grad: no parameter accumulates in it
    return False


def partial_below(node: Any, limit: int = 256) -> bool:
    """Some node within `limit` steps below `node` will not run in this backward: it was asked for the
    gradients of chosen tensors (`autograd.grad`, `backward(inputs=)`), not for the whole graph. A plain
    backward runs every node its loss reaches."""
    if node is None:
        return False
    # `node` itself runs (it is running); torch does not count a backward's root node among the graph's nodes
    seen: set[int] = set()
    todo = [nxt for nxt, _ in node.next_functions]
    while todo and len(seen) < limit:
        n = todo.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        if not will_execute(n):
            return True
        todo.extend(nxt for nxt, _ in n.next_functions)
    return False


def training_backward(params: Iterable[torch.Tensor]) -> bool:
    """Called from a hook on a model output during a backward: is it a training backward, one that adds into
    parameters' `.grad`, rather than a user's `autograd.grad` or `backward(inputs=[x])` for other ends?
    Parameters whose forward ran inside a reentrant activation checkpoint are not in this graph task yet
    (their recomputation runs nested tasks later): then the backward trains unless it is a partial one."""
    if any_accumulates(params):
        return True
    return not partial_below(torch._C._current_autograd_node())


@contextlib.contextmanager
def tensor_hooks_paused(tensors: Iterable[Any]) -> Iterator[None]:
    """The tensors' own hooks (`register_hook`) silenced, for a backward that computes their gradients with a
    nested torch.autograd.grad and returns them to autograd through its node's edges: torch runs a tensor's
    hooks on the gradient autograd.grad captures and again where the edge delivers it, so a user's hook would
    see (and transform) that gradient twice. Each tensor keeps its hooks in `_backward_hooks`, a dict torch
    reads when it calls them."""
    held = []
    for t in tensors:
        hooks = getattr(t, "_backward_hooks", None) if isinstance(t, torch.Tensor) else None
        if hooks:
            held.append((hooks, list(hooks.items())))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, items in held:
            hooks.update(items)
