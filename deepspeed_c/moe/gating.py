"""Top-1, top-2 and top-k routing as DeepSpeed defines it, decided here and computed by the C core.

Each router returns a `Routing`: the load-balancing loss, the capacity, per-route slots in the flat
[E * C] expert buffer (and each slot's route), the per-route combine weights (differentiable: they
are gathered from the softmax) and exp_counts. The formulas (DeepSpeed's sharded_moe behaviour):

    gates = softmax(logits)                    me = mean over tokens of gates
    ce = (routes counted for the loss per expert) / tokens
    top-1  l_aux = sum(me * ce) * E            ce from the only route
    top-2  l_aux = mean(me * ce) * E * E       ce from the first route only
    top-k  l_aux = mean(me * ce) * E * E / k   ce from all k routes
    capacity = max(ceil(tokens / E * capacity_factor * k), min_capacity)   (k = 1 for top-1)
    exp_counts = routes per expert before any drop

Drops (drop_tokens=True): top-1 keeps per expert the `capacity` routes with the highest random score
when use_rts (uniform draws of shape [tokens, E], as DeepSpeed draws them), else its first routes in
token order; top-2 keeps routes whose position counts first choices before second choices; top-k keeps
the highest gate probabilities ("probs") or the first routes in token order ("position").
drop_tokens=False: capacity = the largest exp_counts, maximised over the expert-parallel group
(top-1 also caps it at the token count). Combine weights: top-1 the raw gate of a kept route; top-2
and top-k the kept routes' gates over their sum (clamped at the dtype's eps)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from deepspeed_c.moe import gating_core as core

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
DROP_POLICIES = ("probs", "position")

_gumbel: dict[torch.device, Callable] = {}
_uniform: dict[tuple[torch.device, float], Callable] = {}


@dataclass
class Routing:
    l_aux: torch.Tensor
    capacity: int
    num_experts: int
    idx: torch.Tensor  # [S, k] the chosen experts
    route_slot: torch.Tensor  # [S, k] slot in the [E * C] buffer, -1 dropped
    slot_route: torch.Tensor  # [E * C] route (s * k + r) in each slot, -1 empty
    weights: torch.Tensor  # [S, k] combine weights (0 for a dropped route), differentiable
    exp_counts: torch.Tensor  # [E] int64

    @property
    def locations(self) -> torch.Tensor:
        """Each route's location inside its expert's buffer (-1 dropped)."""
        kept = self.route_slot >= 0
        return torch.where(kept, self.route_slot - self.idx * self.capacity, torch.full_like(self.route_slot, -1))


def gumbel_rsample(shape: tuple, device: torch.device) -> torch.Tensor:
    """Standard Gumbel noise (torch's Gumbel(0, 1) sampler, cached per device as DeepSpeed does)."""
    sample = _gumbel.get(device)
    if sample is None:
        sample = torch.distributions.gumbel.Gumbel(torch.tensor(0.0, device=device),
                                                   torch.tensor(1.0, device=device)).rsample
        _gumbel[device] = sample
    return sample(shape)


def multiplicative_jitter(x: torch.Tensor, device: torch.device, epsilon: float = 1e-2) -> torch.Tensor:
    """x times uniform noise in [1 - epsilon, 1 + epsilon) (the Switch Transformer's input jitter)."""
    if epsilon == 0:
        return x
    sample = _uniform.get((device, epsilon))
    if sample is None:
        sample = torch.distributions.uniform.Uniform(torch.tensor(1.0 - epsilon, device=device),
                                                     torch.tensor(1.0 + epsilon, device=device)).rsample
        _uniform[(device, epsilon)] = sample
    return x * sample(x.shape)


def capacity_for(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    # float32 arithmetic, as DeepSpeed's tensor expression computes it
    cap = torch.ceil(torch.tensor(capacity_factor, dtype=torch.float32) * (num_tokens / num_experts))
    return max(int(cap.item()), int(min_capacity))


def _group_max(value: int, device: torch.device, ep_group: Any) -> int:
    """The largest value over the expert-parallel group (drop_tokens=False keeps capacities equal)."""
    if ep_group is None:
        return value
    import deepspeed_c.comm as dist

    if dist.get_world_size(group=ep_group) <= 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ep_group)
    return int(t.item())


def _kept(route_slot: torch.Tensor) -> torch.Tensor:
    return (route_slot >= 0).to(torch.float32)


def _normalized(gates: torch.Tensor, idx: torch.Tensor, route_slot: torch.Tensor) -> torch.Tensor:
    g = gates.gather(1, idx) * _kept(route_slot).to(gates.dtype)
    denom = torch.clamp(g.sum(dim=1, keepdim=True), min=torch.finfo(g.dtype).eps)
    return g / denom


def _check_logits(logits: torch.Tensor, k: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"gating logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"k={k} must be between 1 and num_experts={logits.shape[1]}")


def route_top1(logits: torch.Tensor, capacity_factor: float, min_capacity: int,
               used_token: Optional[torch.Tensor] = None, noisy_gate_policy: Optional[str] = None,
               drop_tokens: bool = True, use_rts: bool = True, ep_group: Any = None) -> Routing:
    _check_logits(logits, 1)
    S, E = logits.shape
    gates = F.softmax(logits, dim=1)
    capacity = capacity_for(S, E, capacity_factor, min_capacity)
    rank_by = logits + gumbel_rsample(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    idx = core.select(rank_by, 1)
    used = None
    if used_token is not None:
        if used_token.shape != (S,):
            raise ValueError(f"used_token must have one entry per token ({S}), got shape {tuple(used_token.shape)}")
        used = (used_token != 0).to(torch.uint8).contiguous()
    exp_counts = core.counts(idx, E, used)
    if not drop_tokens:
        capacity = min(_group_max(int(exp_counts.max().item()), logits.device, ep_group), S)
    me = gates.mean(dim=0)
    ce = exp_counts.to(torch.float32) / S
    l_aux = torch.sum(me * ce) * E
    score = None
    if use_rts:
        # one uniform draw per (token, expert), as DeepSpeed draws them, so a seed gives the same choice
        score = torch.rand(S, E, device=logits.device).gather(1, idx)
    if S < min_capacity:
        raise ValueError(f"top-1 gating needs at least min_capacity={min_capacity} tokens, got {S}: lower "
                         "min_capacity or raise the batch size")
    route_slot, slot_route = core.plan(idx, E, capacity, core.TOKEN_MAJOR, score=score, used=used)
    weights = gates.gather(1, idx) * _kept(route_slot)
    return Routing(l_aux, capacity, E, idx, route_slot, slot_route, weights, exp_counts)


def route_top2(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, top2_2nd_expert_sampling: bool = True) -> Routing:
    _check_logits(logits, 2)
    S, E = logits.shape
    gates = F.softmax(logits, dim=1)
    second = logits.detach()
    if top2_2nd_expert_sampling:
        second = second + gumbel_rsample(logits.shape, logits.device)  # Gumbel-max sampling of the 2nd expert
    idx = core.select(gates, 2, secondary=second)
    exp_counts = core.counts(idx, E)
    first_counts = core.counts(idx[:, :1], E)
    me = gates.mean(dim=0)
    ce = first_counts.to(torch.float32) / S
    l_aux = torch.mean(me * ce) * E * E
    if drop_tokens:
        capacity = capacity_for(S, E, capacity_factor * 2, min_capacity)
    else:
        capacity = _group_max(int(exp_counts.max().item()), logits.device, ep_group)
    route_slot, slot_route = core.plan(idx, E, capacity, core.ROUTE_MAJOR)
    weights = _normalized(gates, idx, route_slot)
    return Routing(l_aux, capacity, E, idx, route_slot, slot_route, weights, exp_counts)


def route_topk(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, drop_policy: str = "probs") -> Routing:
    _check_logits(logits, k)
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    S, E = logits.shape
    gates = F.softmax(logits, dim=1)
    idx = core.select(gates, k)
    exp_counts = core.counts(idx, E)
    me = gates.mean(dim=0)
    ce = exp_counts.to(torch.float32) / S
    l_aux = torch.mean(me * ce) * E * E / k
    score = None
    if drop_tokens:
        capacity = capacity_for(S, E, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            score = gates.detach().gather(1, idx)
    else:
        capacity = _group_max(int(exp_counts.max().item()), logits.device, ep_group)
    route_slot, slot_route = core.plan(idx, E, capacity, core.TOKEN_MAJOR, score=score)
    weights = _normalized(gates, idx, route_slot)
    return Routing(l_aux, capacity, E, idx, route_slot, slot_route, weights, exp_counts)


def dense_combine_weights(r: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSpeed's dense (combine_weights [S, E, C], dispatch_mask) for callers of the public
    top{1,2,k}gating functions; the layer itself never builds them."""
    S, k = r.idx.shape
    cw = torch.zeros(S, r.num_experts * r.capacity, dtype=r.weights.dtype, device=r.weights.device)
    kept = r.route_slot >= 0
    rows = torch.arange(S, device=r.idx.device).unsqueeze(1).expand(S, k)
    cw = cw.index_put((rows[kept], r.route_slot[kept]), r.weights[kept], accumulate=True)
    cw = cw.view(S, r.num_experts, r.capacity)
    return cw, cw.bool()


__all__ = ["Routing", "route_top1", "route_top2", "route_topk", "capacity_for", "gumbel_rsample",
           "multiplicative_jitter", "dense_combine_weights", "NOISY_GATE_POLICIES"]
