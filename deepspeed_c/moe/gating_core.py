"""The Python face of the C/CUDA MoE gating core (csrc/core/moe_gating.c, csrc/cuda/moe_gating.cu).

Python decides (which scores rank which routes, what the capacity is), the core computes: top-k
selection, per-expert counts, the capacity plan (each route's slot in the flat [E * C] expert
buffer, each slot's route) and the row moves. Dispatch and combine are torch.autograd.Functions
whose backward passes are the same moves the other way round, so no [tokens, experts, capacity]
tensor is ever built, forward or backward.

The C moves are constants to autograd: a create_graph backward (grad mode on inside backward) forms the
gradients with torch's differentiable indexing instead (the same sums), and under a torch.func transform
dispatch/combine are that torch composition, no custom Function. The routing decisions (select, counts,
plan) take no gradient; under torch.func.grad their inputs are read through the transform's wrappers, and
under vmap they raise (capacity couples the tokens of a batch: a per-sample routing is another routing)."""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from deepspeed_c.runtime.autograd_paths import tensor_hooks_paused, transforms_active

TOKEN_MAJOR = 0  # a route's location counts the earlier kept routes of its expert in token order
ROUTE_MAJOR = 1  # ... in route order: every token's first choice, then every token's second (top-2)


@functools.lru_cache(maxsize=None)
def _cpu_op() -> Any:
    from deepspeed_c.ops.op_builder import MoEGatingBuilder

    return MoEGatingBuilder().load()


@functools.lru_cache(maxsize=None)
def _cuda_op() -> Any:
    from deepspeed_c.ops.op_builder import MoEGatingCUDABuilder

    return MoEGatingCUDABuilder().load()


def op_for(device: torch.device) -> Any:
    if device.type == "cpu":
        return _cpu_op()
    if device.type == "cuda":
        return _cuda_op()
    raise NotImplementedError(f"deepspeed_c.moe: the gating core runs on cpu and cuda tensors, got {device.type}")


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor under torch.func.grad's wrappers (the routing takes no gradient); a vmap raises."""
    if torch.compiler.is_compiling() or not transforms_active():
        return t
    from torch._C import _functorch as ft

    t = t.detach()
    while ft.is_functorch_wrapped_tensor(t):
        if ft.is_batchedtensor(t):
            raise RuntimeError("deepspeed_c.moe gating: the MoE routing cannot run under torch.func.vmap (expert "
                               "capacity couples the tokens of a batch, so per-sample routing is a different "
                               "routing); use torch.func.grad or autograd over the whole batch")
        t = ft.get_unwrapped(t)
    return t


def _f32(t: torch.Tensor) -> torch.Tensor:
    return _plain(t.detach().to(torch.float32).contiguous())


def select(primary: torch.Tensor, k: int, secondary: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[S, k] int64: route 0 is the argmax of primary's row, routes 1.. successive argmaxes of
    secondary's (primary's when None) over the experts not chosen yet."""
    S, _ = primary.shape
    idx = torch.empty(S, k, dtype=torch.int64, device=primary.device)
    op_for(primary.device).select(_f32(primary), None if secondary is None else _f32(secondary), int(k), _plain(idx))
    return idx


def counts(idx: torch.Tensor, num_experts: int, used: Optional[torch.Tensor] = None) -> torch.Tensor:
    """exp_counts: routes of used tokens per expert (int64 [E])."""
    out = torch.empty(num_experts, dtype=torch.int64, device=idx.device)
    op_for(idx.device).counts(_plain(idx.contiguous()), None if used is None else _plain(used), int(num_experts),
                              _plain(out))
    return out


def plan(idx: torch.Tensor, num_experts: int, capacity: int, order: int, score: Optional[torch.Tensor] = None,
         used: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(route_slot [S, k], slot_route [E * C]): each route's slot (-1 dropped), each slot's route
    (-1 empty). With score, an over-full expert keeps its highest-scoring routes."""
    S, k = idx.shape
    route_slot = torch.empty(S, k, dtype=torch.int64, device=idx.device)
    slot_route = torch.empty(num_experts * capacity, dtype=torch.int64, device=idx.device)
    op_for(idx.device).plan(_plain(idx.contiguous()), None if score is None else _f32(score),
                            None if used is None else _plain(used), int(num_experts),
                            int(capacity), int(order), _plain(route_slot), _plain(slot_route))
    return route_slot, slot_route


def _weight_dtype(rows: torch.Tensor) -> torch.dtype:
    return torch.float64 if rows.dtype == torch.float64 else torch.float32


def dispatch_rows(x: torch.Tensor, slot_route: torch.Tensor, k: int, w: Optional[torch.Tensor] = None) -> torch.Tensor:
    out = torch.empty(slot_route.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    wc = None if w is None else w.detach().to(_weight_dtype(x)).contiguous().reshape(-1)
    op_for(x.device).dispatch(x.contiguous(), slot_route, int(k), wc, out)
    return out


def combine_rows(y: torch.Tensor, route_slot: torch.Tensor, w: Optional[torch.Tensor] = None) -> torch.Tensor:
    out = torch.empty(route_slot.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
    wc = None if w is None else w.detach().to(_weight_dtype(y)).contiguous()
    op_for(y.device).combine(y.contiguous(), route_slot, wc, out)
    return out


def route_dots(g: torch.Tensor, y: torch.Tensor, route_slot: torch.Tensor) -> torch.Tensor:
    out = torch.empty(route_slot.shape, dtype=_weight_dtype(g), device=g.device)
    op_for(g.device).route_dots(g.contiguous(), y.contiguous(), route_slot, out)
    return out


def _torch_dispatch(x: torch.Tensor, slot_route: torch.Tensor, k: int) -> torch.Tensor:
    """dispatch_rows through torch indexing (differentiable): slot j takes token slot_route[j] // k, zeros if empty."""
    pad = torch.cat([x, x.new_zeros(1, x.shape[1])])
    return pad[torch.where(slot_route >= 0, slot_route // k, x.shape[0])]


def _torch_combine(y: torch.Tensor, route_slot: torch.Tensor, w: Optional[torch.Tensor]) -> torch.Tensor:
    """combine_rows through torch indexing: out[s] = sum_r (w[s, r] *) y[route_slot[s, r]], in fp32 (fp64)."""
    acc = _weight_dtype(y)
    pad = torch.cat([y, y.new_zeros(1, y.shape[1])])
    rows = pad[torch.where(route_slot >= 0, route_slot, y.shape[0])].to(acc)  # [S, k, M]
    if w is not None:
        rows = rows * w.to(acc).unsqueeze(-1)
    return rows.sum(1).to(y.dtype)


class Dispatch(torch.autograd.Function):
    """x [S, M] -> [E * C, M]: slot j holds its route's token (zeros when empty)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, route_slot: torch.Tensor, slot_route: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(route_slot)
        return dispatch_rows(x, slot_route, route_slot.shape[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        (route_slot,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the gradient stays differentiable in grad
            return _torch_combine(grad, route_slot, None), None, None
        return combine_rows(grad, route_slot), None, None


class Combine(torch.autograd.Function):
    """y [E * C, M], w [S, k] -> [S, M]: out[s] = sum_r w[s, r] * y[slot of (s, r)], in fp32."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, w: torch.Tensor, route_slot: torch.Tensor,
                slot_route: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y, w, route_slot, slot_route)
        return combine_rows(y, route_slot, w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], None, None]:
        y, w, route_slot, slot_route = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: torch's gradients of the same sum, differentiable
            wrt = [t for t, need in zip((y, w), ctx.needs_input_grad[:2]) if need]
            with tensor_hooks_paused(wrt):  # the edges deliver these gradients: hooks run there, once
                got = iter(torch.autograd.grad(_torch_combine(y, route_slot, w), wrt, grad, create_graph=True))
            return (next(got) if ctx.needs_input_grad[0] else None, next(got) if ctx.needs_input_grad[1] else None,
                    None, None)
        grad = grad.contiguous()
        gy = dispatch_rows(grad, slot_route, route_slot.shape[1], w) if ctx.needs_input_grad[0] else None
        gw = route_dots(grad, y, route_slot).to(w.dtype) if ctx.needs_input_grad[1] else None
        return gy, gw, None, None


def dispatch(x: torch.Tensor, route_slot: torch.Tensor, slot_route: torch.Tensor) -> torch.Tensor:
    if not torch.compiler.is_compiling() and transforms_active():
        return _torch_dispatch(x, slot_route, route_slot.shape[1])
    return Dispatch.apply(x, route_slot, slot_route)


def combine(y: torch.Tensor, w: torch.Tensor, route_slot: torch.Tensor, slot_route: torch.Tensor) -> torch.Tensor:
    if not torch.compiler.is_compiling() and transforms_active():
        return _torch_combine(y, route_slot, w)
    return Combine.apply(y, w, route_slot, slot_route)
