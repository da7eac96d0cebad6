"""A param group's launch plan for the fused CUDA optimizers, kept between steps.

A step over hundreds of tensors spends most of its host time re-deriving what does not change
from one step to the next: which parameters have state, their dtype and device checks, the state
lookups, the per-parameter step counters and the bucketing by (device, step). The plan does that
once and, on later steps, only verifies that it still holds (the same parameters have gradients,
the state dict still holds the tensors it recorded, the step counters are unchanged) before
launching. Anything else rebuilds it, so the result is always that of the uncached path.

From an idle queue the GPU waits for the host's work before the first launch, so a bucket on CUDA
is launched in chunks of growing size (8, 32, 128, ... tensors): each chunk is verified and
launched on its own, and the host checks the next chunk while the GPU runs the previous one. A
chunk that no longer matches the plan stops it there: the chunks already launched were verified,
so they are exactly what the uncached path would have run, and the rest of the group is stepped
by a fresh plan that leaves them out.

Step counters stay in torch's format (a 0-dim float32 CPU tensor per parameter, so state dicts
load into torch.optim.AdamW and back), but the parameters of one bucket share one flat counter
tensor through views, so a step advances all of them with one in-place add."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any

import torch

from deepspeed_c import _C
from deepspeed_c.ops import fused_optimizer_utils as fu

# launch(params, grads, moments per key, step after this update): one kernel call
Launch = Callable[[list[torch.Tensor], list[torch.Tensor], list[list[torch.Tensor]], int], None]

FIRST_CHUNK = 8   # tensors in a CUDA bucket's first launch: what the GPU waits for from an idle queue
CHUNK_GROWTH = 4  # each later chunk is this much larger; the host (~1 us a tensor) stays ahead of
                  # the GPU (microseconds a tensor for any tensor worth a fused kernel)

PIPELINED_DEVICES = frozenset({"cuda"})  # host kernels run synchronously: nothing to overlap there

_grad_of = attrgetter("grad")


def chunk_bounds(n: int, pipelined: bool) -> list[tuple[int, int]]:
    """[start, end) ranges cutting n tensors into launches of FIRST_CHUNK, x CHUNK_GROWTH, ..."""
    if not pipelined:
        return [(0, n)]
    out, start, size = [], 0, FIRST_CHUNK
    while start < n:
        out.append((start, min(n, start + size)))
        start, size = start + size, size * CHUNK_GROWTH
    return out


class _Chunk:
    __slots__ = ("start", "params", "states", "moments", "entries")

    def __init__(self, start: int, params: list[torch.Tensor], states: list[dict[str, Any]],
                 moment_keys: Sequence[str]) -> None:
        self.start = start
        self.params = params
        self.states = states
        self.moments = [[s[k] for s in states] for k in moment_keys]
        self.entries = [(k, [s[k] for s in states]) for k in ("step", *moment_keys)]

    def stale(self, grads: list[torch.Tensor | None]) -> bool:
        """A gradient gone, or a state tensor no longer the one recorded (pointer compares in C:
        from Python, ids cost ~0.4 us a tensor on some hosts, which an idle GPU waits for)."""
        if _C.any_none(grads):
            return True
        return not all(_C.entries_are(self.states, k, want) for k, want in self.entries)


class _Bucket:
    __slots__ = ("positions", "params", "moments", "counters", "step", "states", "chunks", "version")

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
        self.version = self.counters._version  # an in-place edit of any counter view bumps it
        pipelined = params[0].device.type in PIPELINED_DEVICES
        self.chunks = [_Chunk(a, params[a:b], states[a:b], moment_keys) for a, b in chunk_bounds(len(params), pipelined)]


class FusedStepPlan:
    """Buckets of one param group: parameters with gradients, grouped by (device, step)."""

    def __init__(self, optimizer: torch.optim.Optimizer, group: dict[str, Any], moment_keys: Sequence[str],
                 name: str, sparse_error: type[Exception] = RuntimeError, require_cuda: bool = True,
                 exclude: frozenset[int] = frozenset()) -> None:
        self.moment_keys = tuple(moment_keys)
        params = group["params"]
        self.present = [i for i, p in enumerate(params) if p.grad is not None and i not in exclude]
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
        self.params = list(params)
        present = set(self.present)
        self.absent = [i for i in range(len(params)) if i not in present]
        self.present_mask = [i in present for i in range(len(params))]
        self.state_obj = optimizer.state
        self.state_len = len(optimizer.state)

    def holds_before_launch(self, optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
        """What must hold before anything is launched: the state dict not replaced as a whole
        (torch's load_state_dict) nor grown, the same parameters, no gradient where the plan has
        none, each bucket's counters still equal. The per-chunk rest is checked as it launches."""
        if optimizer.state is not self.state_obj or len(self.state_obj) != self.state_len:
            return False
        params = group["params"]
        if not _C.same_objects(params, self.params):
            return False
        if self.absent and not all(params[i].grad is None for i in self.absent):
            return False
        return all(b.counters._version == b.version for b in self.buckets)

    def still_holds(self, optimizer: torch.optim.Optimizer, group: dict[str, Any],
                    grads: list[torch.Tensor | None]) -> bool:
        """The whole check at once (no launch in between)."""
        if not self.holds_before_launch(optimizer, group):
            return False
        if [g is not None for g in grads] != self.present_mask:
            return False
        return not any(c.stale([grads[i] for i in b.positions[c.start:c.start + len(c.params)]])
                       for b in self.buckets for c in b.chunks)

    def run(self, launch: Launch, verify: bool) -> set[int] | None:
        """Launches every chunk of every bucket and advances the counters. With verify, a chunk
        whose gradients or state tensors are no longer those of the plan stops it: returns the
        group positions stepped so far (their counters advanced), for a fresh plan to skip."""
        for bi, b in enumerate(self.buckets):
            for c in b.chunks:
                grads = list(map(_grad_of, c.params))
                if verify and c.stale(grads):
                    if c.start:
                        b.counters[:c.start].add_(1.0)
                    return {i for d in self.buckets[:bi] for i in d.positions} | set(b.positions[:c.start])
                launch(c.params, grads, c.moments, b.step + 1)
            self.advance(b)
        return None

    def launches(self, grads: list[torch.Tensor | None]) -> list[tuple[_Bucket, list[torch.Tensor]]]:
        """(bucket, its gradients) for each bucket; advance() each bucket after its kernel ran."""
        return [(b, [grads[i] for i in b.positions]) for b in self.buckets]

    @staticmethod
    def advance(bucket: _Bucket) -> None:
        bucket.counters.add_(1.0)
        bucket.step += 1
        bucket.version = bucket.counters._version


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

    def step(self, optimizer: torch.optim.Optimizer, index: int, group: dict[str, Any], moment_keys: Sequence[str],
             name: str, launch: Launch, sparse_error: type[Exception] = RuntimeError,
             require_cuda: bool = True) -> None:
        """One optimizer step of param group `index` through its plan (kept, checked chunk by
        chunk as it launches, or rebuilt)."""
        plan = self._plans.get(index)
        if plan is not None and plan.holds_before_launch(optimizer, group):
            stepped = plan.run(launch, verify=True)
            if stepped is None:
                return
            del self._plans[index]  # stale from some chunk on: the rest by a fresh plan, not kept
            FusedStepPlan(optimizer, group, moment_keys, name, sparse_error, require_cuda,
                          exclude=frozenset(stepped)).run(launch, verify=False)
            return
        plan = self._plans[index] = FusedStepPlan(optimizer, group, moment_keys, name, sparse_error, require_cuda)
        plan.run(launch, verify=False)
