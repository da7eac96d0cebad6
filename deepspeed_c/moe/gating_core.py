"""The Python face of the C/CUDA MoE gating core (csrc/core/moe_gating.c, csrc/cuda/moe_gating.cu).

Python decides (which scores rank which routes, what the capacity is), the core computes: top-k
selection, per-expert counts, the capacity plan (each route's slot in the flat [E * C] expert
buffer, each slot's route) and the row moves. Dispatch and combine are torch.autograd.Functions
whose backward passes are the same moves the other way round, so no [tokens, experts, capacity]
tensor is ever built, forward or backward."""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

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


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).contiguous()


def select(primary: torch.Tensor, k: int, secondary: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[S, k] int64: route 0 is the argmax of primary's row, routes 1.. successive argmaxes of
    secondary's (primary's when None) over the experts not chosen yet."""
    S, _ = primary.shape
    idx = torch.empty(S, k, dtype=torch.int64, device=primary.device)
    op_for(primary.device).select(_f32(primary), None if secondary is None else _f32(secondary), int(k), idx)
    return idx


def counts(idx: torch.Tensor, num_experts: int, used: Optional[torch.Tensor] = None) -> torch.Tensor:
    """exp_counts: routes of used tokens per expert (int64 [E])."""
    out = torch.empty(num_experts, dtype=torch.int64, device=idx.device)
    op_for(idx.device).counts(idx.contiguous(), used, int(num_experts), out)
    return out


def plan(idx: torch.Tensor, num_experts: int, capacity: int, order: int, score: Optional[torch.Tensor] = None,
         used: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(route_slot [S, k], slot_route [E * C]): each route's slot (-1 dropped), each slot's route
    (-1 empty). With score, an over-full expert keeps its highest-scoring routes."""
    S, k = idx.shape
    route_slot = torch.empty(S, k, dtype=torch.int64, device=idx.device)
    slot_route = torch.empty(num_experts * capacity, dtype=torch.int64, device=idx.device)
    op_for(idx.device).plan(idx.contiguous(), None if score is None else _f32(score), used, int(num_experts),
                            int(capacity), int(order), route_slot, slot_route)
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


class Dispatch(torch.autograd.Function):
    """x [S, M] -> [E * C, M]: slot j holds its route's token (zeros when empty)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, route_slot: torch.Tensor, slot_route: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(route_slot)
        return dispatch_rows(x, slot_route, route_slot.shape[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        (route_slot,) = ctx.saved_tensors
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
        grad = grad.contiguous()
        gy = dispatch_rows(grad, slot_route, route_slot.shape[1], w) if ctx.needs_input_grad[0] else None
        gw = route_dots(grad, y, route_slot).to(w.dtype) if ctx.needs_input_grad[1] else None
        return gy, gw, None, None


def dispatch(x: torch.Tensor, route_slot: torch.Tensor, slot_route: torch.Tensor) -> torch.Tensor:
    return Dispatch.apply(x, route_slot, slot_route)


def combine(y: torch.Tensor, w: torch.Tensor, route_slot: torch.Tensor, slot_route: torch.Tensor) -> torch.Tensor:
    return Combine.apply(y, w, route_slot, slot_route)
