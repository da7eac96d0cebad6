"""A param group's launch plan for the fused CUDA optimizers, kept between steps.

A step over hundreds of tensors spends most of its host time re-deriving what does not change
from one step to the next: which parameters have state, their dtype and device checks, the state
lookups, the per-parameter step counters and the bucketing by (device, step). The plan does that
once and, on later steps, only verifies that it still holds (the same parameters have gradients,
the state dict still holds the tensors it recorded, the step counters are unchanged) before
launching. Anything else rebuilds it, so the result is always that of the uncached path.

Step counters stay in torch's format (a 0-dim float32 CPU tensor per parameter, so state dicts
load into torch.optim.AdamW and back), but the parameters of one bucket share one flat counter
tensor through views, so a step advances all of them with one in-place add."""
from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter
from typing import Any

import torch

from deepspeed_c.ops import fused_optimizer_utils as fu


class _Bucket:
    __slots__ = ("positions", "params", "moments", "counters", "step", "states", "ids")

    def __init__(self, positions: list[int], params: list[torch.Tensor], states: list[dict[str, Any]],
                 moment_keys: Sequence[str], step: int) -> None:
        self.positions = positions
        self.params = params
        self.moments = [[s[k] for s in states] for k in moment_keys]
        self.step = step
        self.counters = torch.full((len(params),), float(step), dtype=torch.float32)
        for i, s in enumerate(states):
            s["step"] = self.counters[i]
        self.states = states
        self.ids = _state_ids(states, moment_keys)


def _state_ids(states: Sequence[dict[str, Any]], moment_keys: Sequence[str]) -> list[list[int]]:
    # map/itemgetter run in C: ~30 ns a tensor, where a per-parameter `optimizer.state[p]` lookup goes
    # through torch.Tensor.__hash__ in Python (the idle-queue step over 256 tensors felt each one)
    return [list(map(id, map(itemgetter(k), states))) for k in ("step", *moment_keys)]


class FusedStepPlan:
    """Buckets of one param group: parameters with gradients, grouped by (device, step)."""

    def __init__(self, optimizer: torch.optim.Optimizer, group: dict[str, Any], moment_keys: Sequence[str],
                 name: str, sparse_error: type[Exception] = RuntimeError, require_cuda: bool = True) -> None:
        self.moment_keys = tuple(moment_keys)
        params = group["params"]
        self.present = [i for i, p in enumerate(params) if p.grad is not None]
        states = []
        for i in self.present:
            p = params[i]
            fu.check_param(p, p.grad, name, sparse_error, require_cuda)
            state = optimizer.state[p]
            if len(state) == 0:
                fu.init_state(state, group, p, moment_keys)
            else:
                fu.normalize_state(state, p, moment_keys)
            states.append(state)
        keys = zip((params[i].device for i in self.present), (int(s["step"]) for s in states))
        self.buckets = []
        for (_, step), idx in fu.bucket(keys).items():
            self.buckets.append(_Bucket([self.present[j] for j in idx], [params[self.present[j]] for j in idx],
                                        [states[j] for j in idx], moment_keys, step))
        self.param_ids = list(map(id, params))
        self.present_mask = [p.grad is not None for p in params]
        self.state_obj = optimizer.state
        self.state_len = len(optimizer.state)

    def still_holds(self, optimizer: torch.optim.Optimizer, group: dict[str, Any],
                    grads: list[torch.Tensor | None]) -> bool:
        # a state dict replaced as a whole (torch's load_state_dict) or grown; the same parameters;
        # the same ones holding gradients; then every recorded state tensor still the one in place
        if optimizer.state is not self.state_obj or len(self.state_obj) != self.state_len:
            return False
        if list(map(id, group["params"])) != self.param_ids:
            return False
        if [g is not None for g in grads] != self.present_mask:
            return False
        for b in self.buckets:
            if _state_ids(b.states, self.moment_keys) != b.ids:
                return False
            counters = b.counters.tolist()
            if min(counters) != max(counters) or counters[0] != b.step:
                return False
        return True

    def launches(self, grads: list[torch.Tensor | None]) -> list[tuple[_Bucket, list[torch.Tensor]]]:
        """(bucket, its gradients) for each launch; advance() each bucket after its kernel ran."""
        return [(b, [grads[i] for i in b.positions]) for b in self.buckets]

    @staticmethod
    def advance(bucket: _Bucket) -> None:
        bucket.counters.add_(1.0)
        bucket.step += 1


class PlanCache:
    """The plans of an optimizer's param groups, dropped whenever its state may have been replaced."""

    def __init__(self) -> None:
        self._plans: dict[int, FusedStepPlan] = {}

    def clear(self) -> None:
        self._plans.clear()

    def plan(self, optimizer: torch.optim.Optimizer, index: int, group: dict[str, Any],
             grads: list[torch.Tensor | None], moment_keys: Sequence[str], name: str,
             sparse_error: type[Exception] = RuntimeError, require_cuda: bool = True) -> FusedStepPlan:
        plan = self._plans.get(index)
        if plan is None or not plan.still_holds(optimizer, group, grads):
            plan = self._plans[index] = FusedStepPlan(optimizer, group, moment_keys, name, sparse_error, require_cuda)
        return plan
