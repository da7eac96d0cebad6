"""The ways users call autograd, checked on one module against a float64 plain-torch reference of its math.

A Case holds our module (fp32, maybe one tensor-parallel shard of a layer), the reference function over full
float64 parameters, and `shard(name, full)`: our rank's piece of a full parameter-shaped tensor. `run(case)`
returns {check name: worst norm-wise relative error}; the calls:
  grad       `autograd.grad(loss, [x, w])` (leaving every .grad None)
  backward   `.backward()`'s grads
  inputs     `loss.backward(inputs=[x])`: x.grad right, every parameter's .grad left None
  cg_x/cg_w  `g = autograd.grad(loss, x or w, create_graph=True)`, then `(loss + |g|).backward()`: all grads
  func       `torch.func.grad` over `functional_call(module, params, (x,))`
  vmap       `vmap(grad(...))` per-sample gradients (when the case allows it)
  accum      two backwards accumulated into .grad
A sharded weight's penalty norm is the norm of the whole gradient (its squares summed over the group through
a differentiable all-reduce `reduce`), so every rank's loss stays the same number."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Union

import torch

Tensor = torch.Tensor


@dataclasses.dataclass
class Case:
    module: torch.nn.Module
    ref: Callable[[dict[str, Tensor], Tensor], Tensor]  # (float64 full params, float64 x) -> per-row output
    full: dict[str, Tensor]  # float64 full parameters, by our module's parameter names
    x: Tensor  # [batch, features] fp32
    weight: str  # the parameter the create_graph penalty differentiates
    shard: Callable[[str, Tensor], Tensor] = lambda name, t: t
    sharded: frozenset = frozenset()  # parameters cut over the group (their penalty norm is reduced)
    reduce: Callable[[Tensor], Tensor] = lambda t: t  # differentiable sum over the group
    vmap: bool = True
    x2: Optional[Tensor] = None  # a second batch for the accumulation check


def _loss(out: Tensor) -> Tensor:
    weights = torch.linspace(0.5, 1.5, out.shape[-1], dtype=out.dtype, device=out.device)  # the output's device
    return (out.sin() * weights).sum()


def _rel(a: Optional[Tensor], b: Tensor) -> float:
    if a is None:
        return float("inf")
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def _ref_grads(case: Case, x: Tensor, penalty: Optional[str] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The reference's gradients of x and every parameter for loss (+ the create_graph penalty)."""
    params = {k: v.detach().clone().requires_grad_() for k, v in case.full.items()}
    x64 = x.double().requires_grad_()
    loss = _loss(case.ref(params, x64))
    if penalty is not None:
        t = x64 if penalty == "x" else params[case.weight]
        g, = torch.autograd.grad(loss, t, create_graph=True)
        loss = loss + g.pow(2).sum().sqrt()
    gx, *gp = torch.autograd.grad(loss, [x64, *params.values()])
    return gx, {k: case.shard(k, g) for k, g in zip(params, gp)}


def _clear(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


ALL = ("grad", "backward", "inputs", "cg_x", "cg_w", "func", "vmap", "accum")


def run(case: Case, checks: tuple = ALL) -> dict[str, float]:
    m, errs = case.module, {}
    params = dict(m.named_parameters())
    w = params[case.weight]
    rgx, rgp = _ref_grads(case, case.x)

    if "grad" in checks:
        _clear(m)
        x = case.x.clone().requires_grad_()
        gx, gw = torch.autograd.grad(_loss(m(x)), [x, w])
        errs["grad"] = max(_rel(gx, rgx), _rel(gw, rgp[case.weight]))
        if any(p.grad is not None for p in params.values()):
            errs["grad"] = float("inf")  # autograd.grad wrote into .grad
    if "backward" in checks:
        _clear(m)
        x = case.x.clone().requires_grad_()
        _loss(m(x)).backward()
        errs["backward"] = max(_rel(x.grad, rgx), *(_rel(params[k].grad, rgp[k]) for k in params))
    if "inputs" in checks:
        _clear(m)
        x = case.x.clone().requires_grad_()
        _loss(m(x)).backward(inputs=[x])
        errs["inputs"] = _rel(x.grad, rgx)
        if any(p.grad is not None for p in params.values()):
            errs["inputs"] = float("inf")

    for which in ("x", "w"):
        if f"cg_{which}" not in checks:
            continue
        _clear(m)
        x = case.x.clone().requires_grad_()
        loss = _loss(m(x))
        g, = torch.autograd.grad(loss, x if which == "x" else w, create_graph=True)
        sq = g.pow(2).sum()
        if which == "w" and case.weight in case.sharded:
            sq = case.reduce(sq)
        (loss + sq.sqrt()).backward()
        cgx, cgp = _ref_grads(case, case.x, which)
        errs[f"cg_{which}"] = max(_rel(x.grad, cgx), *(_rel(params[k].grad, cgp[k]) for k in params))

    _clear(m)
    detached = {k: v.detach() for k, v in params.items()}

    def floss(p: dict[str, Tensor], xx: Tensor) -> Tensor:
        return _loss(torch.func.functional_call(m, p, (xx,)))

    if "func" in checks:
        fg = torch.func.grad(floss, argnums=(0, 1))(detached, case.x)
        errs["func"] = max(_rel(fg[1], rgx), *(_rel(fg[0][k], rgp[k]) for k in params))
    if case.vmap and "vmap" in checks:
        per = torch.func.vmap(torch.func.grad(lambda p, xx: floss(p, xx[None])), in_dims=(None, 0))(detached, case.x)
        worst = 0.0
        for i in range(case.x.shape[0]):
            _, rp = _ref_grads(case, case.x[i:i + 1])
            worst = max(worst, *(_rel(per[k][i], rp[k]) for k in params))
        errs["vmap"] = worst

    if "accum" in checks:
        _clear(m)
        x2 = case.x2 if case.x2 is not None else case.x.flip(0) * 0.5
        _loss(m(case.x.clone().requires_grad_())).backward()
        _loss(m(x2.clone().requires_grad_())).backward()
        _, rp2 = _ref_grads(case, x2)
        errs["accum"] = max(_rel(params[k].grad, rgp[k] + rp2[k]) for k in params)
    _clear(m)
    return errs


# fp32 against float64, norm-wise relative per tensor; second-order terms pass through one more fp32 backward
TOL = {"grad": 1e-5, "backward": 1e-5, "inputs": 1e-5, "cg_x": 1e-4, "cg_w": 1e-4, "func": 1e-5, "vmap": 1e-5,
       "accum": 1e-5}


def failures(errs: dict[str, float], scale: Union[float, Mapping[str, float]] = 1.0) -> dict[str, float]:
    """The checks of `run`'s answer over their tolerance (NaN counts as over). `scale` multiplies TOL: one
    factor for every check, or a factor per check name (1 for a name it leaves out), for the inputs of a
    lower-precision kernel (the caller states its bound)."""
    factor = (lambda k: scale.get(k, 1.0)) if isinstance(scale, Mapping) else (lambda k: float(scale))
    return {k: v for k, v in errs.items() if not v <= TOL[k] * factor(k)}


def run_raises(fn: Callable[[], Any], *words: str) -> bool:
    """`fn()` raises an error whose message names every one of `words` (case-insensitive)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - any exception type, judged by its message
        msg = str(e).lower()
        return all(w.lower() in msg for w in words)
    return False
