"""The five ways users call autograd, checked on one module against a float64 plain-torch reference.

`check_paths(case)` runs, on the fast module (fp32) and on the reference (the same math in float64, plain
torch, one process):
  1. autograd.grad(loss, [x, *weights]) and .backward() (which must leave .grad alone for autograd.grad);
  2. backward(inputs=[x]): the weights' .grad stays None, x.grad is right;
  3. a create_graph penalty, loss + |d loss / d target|: equal to the reference's, second-order terms
     included, or a RuntimeError naming create_graph and the module;
  4. torch.func.grad over torch.func.functional_call (and vmap(grad) per sample where the case gives one):
     equal, or an error naming the module (never torch's setup_context complaint);
  5. two accumulated backwards: the sum of their gradients.
Under sequence or expert parallelism `x` is this rank's part: `local(full)` cuts the reference's input
gradient to it and `reduce(name, g)` sums a weight gradient over the group before the comparison."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.func import functional_call


def close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    """Norm-wise relative error of one tensor."""
    assert got is not None, f"{what}: no gradient"
    err = (got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


@dataclass
class Case:
    name: str  # the module's name, as its errors must say it
    module: torch.nn.Module  # fp32; its parameters named in `weights` are checked
    loss: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]  # (module or functional view, x) -> scalar
    ref: Callable[[Dict[str, torch.Tensor], torch.Tensor], torch.Tensor]  # float64 params, full x64 -> scalar
    x: torch.Tensor  # this rank's input (fp32)
    x_full: torch.Tensor  # the whole input, for the reference
    x2_full: torch.Tensor  # a second input (step 5)
    weights: List[str]
    local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
    reduce: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, t: t
    tol: float = 2e-5
    penalty_on: str = "x"  # "x" or a weight name
    per_sample: Optional[int] = None  # x's batch dim: vmap(grad) over it must give each sample's gradients
    create_graph_may_raise: bool = False
    func_may_raise: bool = False
    extra: Dict[str, Any] = field(default_factory=dict)


def _call(case: Case, params: Dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return case.loss(_View(case.module, params), x)


class _View:
    """The module with `params` swapped in (torch.func.functional_call) for the length of one call."""

    def __init__(self, module: torch.nn.Module, params: Dict[str, torch.Tensor]) -> None:
        self.module, self.params = module, params

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return functional_call(self.module, self.params, args, kwargs)


def _ref_grads(case: Case, x_full: torch.Tensor, penalty: bool) -> List[torch.Tensor]:
    p64 = {n: p.detach().double().requires_grad_() for n, p in case.module.named_parameters()}
    x64 = x_full.detach().double().requires_grad_()
    loss = case.ref(p64, x64)
    if penalty:
        target = x64 if case.penalty_on == "x" else p64[case.penalty_on]
        (g,) = torch.autograd.grad(loss, target, create_graph=True)
        # the fast side's penalty is each rank's |its part of the gradient|: summed over ranks
        loss = loss + (_penalty_parts(case, g) if case.penalty_on == "x" else g.norm())
    grads = torch.autograd.grad(loss, [x64] + [p64[n] for n in case.weights])
    return [case.local(grads[0])] + list(grads[1:])


def _penalty_parts(case: Case, g_full: torch.Tensor) -> torch.Tensor:
    return case.extra.get("penalty_parts", lambda g: g.norm())(g_full)


def _fresh(case: Case, x: torch.Tensor) -> torch.Tensor:
    for p in case.module.parameters():
        p.grad = None
    return x.detach().clone().requires_grad_()


def _compare(case: Case, got: List[torch.Tensor], want: List[torch.Tensor], step: str) -> None:
    close(got[0], want[0], case.tol, f"{case.name} {step}: x")
    for n, g, w in zip(case.weights, got[1:], want[1:]):
        close(case.reduce(n, g.detach().clone()), w, case.tol, f"{case.name} {step}: {n}")


def check_paths(case: Case) -> None:
    params = dict(case.module.named_parameters())
    ws = [params[n] for n in case.weights]
    want = _ref_grads(case, case.x_full, penalty=False)

    # 1. autograd.grad returns the gradients and leaves .grad alone; .backward() agrees
    x = _fresh(case, case.x)
    got = torch.autograd.grad(_call(case, params, x), [x] + ws)
    assert x.grad is None and all(p.grad is None for p in case.module.parameters()), \
        f"{case.name}: autograd.grad wrote into .grad"
    _compare(case, list(got), want, "autograd.grad")
    x = _fresh(case, case.x)
    _call(case, params, x).backward()
    _compare(case, [x.grad] + [p.grad for p in ws], want, "backward")

    # 2. backward(inputs=[x]) touches x.grad only
    x = _fresh(case, case.x)
    _call(case, params, x).backward(inputs=[x])
    assert all(p.grad is None for p in case.module.parameters()), f"{case.name}: backward(inputs=[x]) wrote .grad"
    close(x.grad, want[0], case.tol, f"{case.name} backward(inputs=[x]): x")

    # 3. a create_graph penalty
    x = _fresh(case, case.x)
    try:
        loss = _call(case, params, x)
        target = x if case.penalty_on == "x" else params[case.penalty_on]
        (g,) = torch.autograd.grad(loss, target, create_graph=True)
        (loss + g.norm()).backward()
    except RuntimeError as err:
        assert case.create_graph_may_raise, f"{case.name}: create_graph raised {err}"
        assert "create_graph" in str(err) and case.name in str(err), f"{case.name}: unclear error {err}"
    else:
        want_p = _ref_grads(case, case.x_full, penalty=True)
        _compare(case, [x.grad] + [p.grad for p in ws], want_p, "create_graph penalty")

    # 4. torch.func.grad over functional_call (and per-sample vmap(grad))
    detached = {n: p.detach() for n, p in params.items()}
    try:
        fn = torch.func.grad(lambda p, xx: _call(case, p, xx), argnums=(0, 1))
        gp, gx = fn(detached, case.x.detach())
    except Exception as err:  # noqa: BLE001 (any failure must at least be clear)
        assert case.func_may_raise and "setup_context" not in str(err) and case.name in str(err), \
            f"{case.name}: torch.func.grad failed: {type(err).__name__}: {err}"
    else:
        _compare(case, [gx] + [gp[n] for n in case.weights], want, "torch.func.grad")
    if case.per_sample is not None:
        _check_per_sample(case, detached)

    # 5. two accumulated backwards are the sum of their gradients
    want2 = _ref_grads(case, case.x2_full, penalty=False)
    x = _fresh(case, case.x)
    _call(case, params, x).backward()
    _call(case, params, x.detach().clone().copy_(case.local(case.x2_full)).requires_grad_()).backward()
    summed = [want[0]] + [a + b for a, b in zip(want[1:], want2[1:])]
    _compare(case, [x.grad] + [p.grad for p in ws], summed, "two backwards")


def _check_per_sample(case: Case, params: Dict[str, torch.Tensor]) -> None:
    """vmap(grad) over x's batch dimension: sample i's gradients are the reference's on that sample alone."""
    bd = case.per_sample
    one = lambda p, xi: _call(case, p, xi.unsqueeze(bd))  # noqa: E731
    gp, gx = torch.func.vmap(torch.func.grad(one, argnums=(0, 1)), in_dims=(None, bd))(params, case.x.detach())
    for i in range(case.x.shape[bd]):
        sample = Case(**{**case.__dict__, "x_full": case.x_full.narrow(bd, i, 1)})
        want = _ref_grads(sample, sample.x_full, penalty=False)
        got = [gx[i].unsqueeze(bd)] + [gp[n][i] for n in case.weights]
        _compare(case, got, want, f"vmap(grad) sample {i}")
