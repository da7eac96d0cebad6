"""The launch plan the fused optimizers keep between steps (deepspeed_c/ops/fused_step_plan.py).

A cached plan must never change a result: every case below that could make a stale plan wrong
(a parameter that loses or regains its gradient, a state tensor replaced from outside, a step
counter edited in place, a param group whose parameters were swapped, a loaded state dict,
non-contiguous gradients) is driven through FusedAdam / FusedLion for several steps and compared
with torch.optim.AdamW (norm-wise relative 1e-5 per tensor, fp32) or a float64 Lion reference.
The plan's invalidation rules themselves are pure Python and are checked on CPU tensors."""
from __future__ import annotations

import copy

import pytest
import torch

from deepspeed_c.ops.fused_step_plan import PlanCache
from tests.unit.cuda_reference import NEEDS_GPU, assert_rel

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _plain_opt(params):
    return torch.optim.SGD(params, lr=0.1)  # any optimizer object: the plan only uses .state


def _with_grads(params):
    for p in params:
        p.grad = torch.randn_like(p)
    return [p.grad for p in params]


def test_plan_is_reused_only_while_it_holds():
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 7, 3)]
    opt = _plain_opt(params)
    group = opt.param_groups[0]
    cache = PlanCache()
    plan = cache.plan(opt, 0, group, _with_grads(params), _MOMENTS, "T", require_cuda=False)
    assert [len(b.params) for b in plan.buckets] == [3]
    assert cache.plan(opt, 0, group, _with_grads(params), _MOMENTS, "T", require_cuda=False) is plan  # nothing changed

    params[1].grad = None  # a parameter without a gradient this step
    plan2 = cache.plan(opt, 0, group, [p.grad for p in params], _MOMENTS, "T", require_cuda=False)
    assert plan2 is not plan and plan2.present == [0, 2]

    plan3 = cache.plan(opt, 0, group, _with_grads(params), _MOMENTS, "T", require_cuda=False)
    assert plan3 is not plan2
    # the parameter that missed a step has its own counter value, so its own bucket
    plan3.advance(plan3.buckets[0])
    plan4 = cache.plan(opt, 0, group, _with_grads(params), _MOMENTS, "T", require_cuda=False)
    assert plan4 is plan3
    assert sorted(len(b.params) for b in plan4.buckets) == [3]  # all counters were 0 at build time

    opt.state[params[0]]["exp_avg"] = torch.zeros(5)  # replaced from outside
    assert cache.plan(opt, 0, group, _with_grads(params), _MOMENTS, "T", require_cuda=False) is not plan4


def test_counters_are_torch_format_views_and_edits_invalidate():
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    opt = _plain_opt(params)
    group = opt.param_groups[0]
    cache = PlanCache()
    plan = cache.plan(opt, 0, group, _with_grads(params), _MOMENTS, "T", require_cuda=False)
    plan.advance(plan.buckets[0])
    plan.advance(plan.buckets[0])
    for p in params:
        step = opt.state[p]["step"]
        assert step.dim() == 0 and step.dtype == torch.float32 and step.device.type == "cpu"
        assert step.item() == 2.0
    opt.state[params[2]]["step"].fill_(7.0)  # edited in place: the counters disagree now
    plan2 = cache.plan(opt, 0, group, _with_grads(params), _MOMENTS, "T", require_cuda=False)
    assert plan2 is not plan
    assert sorted((b.step, len(b.params)) for b in plan2.buckets) == [(2, 2), (7, 1)]


def test_swapped_group_params_rebuild():
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    opt = _plain_opt(params)
    group = opt.param_groups[0]
    cache = PlanCache()
    plan = cache.plan(opt, 0, group, _with_grads(params), _MOMENTS, "T", require_cuda=False)
    group["params"] = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    plan2 = cache.plan(opt, 0, group, _with_grads(group["params"]), _MOMENTS, "T", require_cuda=False)
    assert plan2 is not plan and plan2.buckets[0].params[0] is group["params"][0]


# -- end to end: host tensors (the C CPU kernels) and, where there is one, the GPU ------------------
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_GPU))]


@pytest.mark.parametrize("device", DEVICES)
def test_fused_adam_with_every_invalidation_matches_torch_adamw(device):
    from deepspeed_c.ops.adam import FusedAdam

    torch.manual_seed(0)
    sizes = [1000, 17, 65537, 3, 4096]
    ours = [torch.nn.Parameter(torch.randn(n, device=device)) for n in sizes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)
    a, b = FusedAdam(ours, **hp), torch.optim.AdamW(theirs, foreach=False, **hp)

    def step(skip=(), non_contiguous=False):
        for i, (p, q) in enumerate(zip(ours, theirs)):
            if i in skip:
                p.grad = q.grad = None
                continue
            g = torch.randn(p.numel() * 2, device=device)
            p.grad = g[::2] if non_contiguous else g[: p.numel()].clone()
            q.grad = p.grad.clone()
        a.step()
        b.step()

    for _ in range(3):
        step()
    step(skip={1, 3})                       # two parameters without gradients
    step()                                  # ... and back: two step counts in one group
    step(non_contiguous=True)
    a.state[ours[0]]["exp_avg"] = a.state[ours[0]]["exp_avg"].clone()  # replaced from outside
    step()
    a.load_state_dict(a.state_dict())       # a loaded state
    step()
    assert_rel([p.detach() for p in ours], [q.detach().double() for q in theirs], 1e-5, "FusedAdam vs AdamW")
    for p, q in zip(ours, theirs):
        assert a.state[p]["step"].item() == b.state[q]["step"].item()
    # the cached counters load into torch's AdamW and keep training in agreement
    b2 = torch.optim.AdamW(theirs, **hp)
    # deep-copied, as through torch.save/load (torch's state_dict hands out its live tensors)
    b2.load_state_dict(copy.deepcopy(a.state_dict()))
    b = b2
    step()
    assert_rel([p.detach() for p in ours], [q.detach().double() for q in theirs], 1e-5, "after exchange")


@pytest.mark.parametrize("device", DEVICES)
def test_fused_lion_with_skipped_params_matches_reference(device):
    from deepspeed_c.ops.lion import FusedLion
    from tests.unit.cuda_reference import lion_ref

    torch.manual_seed(1)
    sizes = [300, 5, 1025]
    ours = [torch.nn.Parameter(torch.randn(n, device=device)) for n in sizes]
    ref_p = [p.detach().double().clone() for p in ours]
    ref_m = [torch.zeros_like(r) for r in ref_p]
    hp = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    opt = FusedLion(ours, **hp)
    for k in range(5):
        for i, p in enumerate(ours):
            p.grad = None if (k == 2 and i == 1) else torch.randn_like(p)
        opt.step()
        for i, p in enumerate(ours):
            if p.grad is not None:
                ref_p[i], ref_m[i], _ = lion_ref(ref_p[i], p.grad.double(), ref_m[i], lr=hp["lr"],
                                                 beta1=hp["betas"][0], beta2=hp["betas"][1],
                                                 weight_decay=hp["weight_decay"])
    assert_rel([p.detach() for p in ours], ref_p, 1e-5, "FusedLion")
    assert [opt.state[p]["step"].item() for p in ours] == [5.0, 4.0, 5.0]


def test_chunk_bounds_grow_geometrically():
    from deepspeed_c.ops.fused_step_plan import chunk_bounds

    assert chunk_bounds(256, True) == [(0, 8), (8, 40), (40, 168), (168, 256)]
    assert chunk_bounds(5, True) == [(0, 5)]
    assert chunk_bounds(256, False) == [(0, 256)]


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_launch_stopped_mid_plan_matches_torch_adamw(device, monkeypatch):
    """Launches are verified chunk by chunk: a stale chunk past the first launch (a gradient gone,
    a state tensor replaced, a step counter the plan does not know) must leave the earlier chunks
    stepped once and the rest stepped by a fresh plan, never twice and never skipped."""
    from deepspeed_c.ops import fused_step_plan
    from deepspeed_c.ops.adam import FusedAdam

    monkeypatch.setattr(fused_step_plan, "PIPELINED_DEVICES", frozenset({"cuda", "cpu"}))
    torch.manual_seed(2)
    sizes = [33 + 7 * i for i in range(45)]  # chunks of 8, 32, 5 tensors
    ours = [torch.nn.Parameter(torch.randn(n, device=device)) for n in sizes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    a, b = FusedAdam(ours, **hp), torch.optim.AdamW(theirs, foreach=False, **hp)

    def step(skip=()):
        for i, (p, q) in enumerate(zip(ours, theirs)):
            p.grad = q.grad = None
            if i not in skip:
                p.grad = torch.randn_like(p)
                q.grad = p.grad.clone()
        a.step()
        b.step()

    step()
    step()
    assert [len(c.params) for c in a._plans._plans[0].buckets[0].chunks] == [8, 32, 5]
    step(skip={20})                                   # second chunk loses a gradient
    step()                                            # ... regains it: two step values
    step()
    a.state[ours[43]]["exp_avg_sq"] = a.state[ours[43]]["exp_avg_sq"].clone()  # third chunk's state replaced
    step()
    step(skip={3, 44})                                # first and last chunk
    step()
    assert_rel([p.detach() for p in ours], [q.detach().double() for q in theirs], 1e-5, "chunked FusedAdam")
    assert [a.state[p]["step"].item() for p in ours] == [b.state[q]["step"].item() for q in theirs]


def test_identity_helpers_compare_objects_not_values():
    from deepspeed_c import _C

    a, b = torch.zeros(2), torch.zeros(2)
    assert _C.same_objects([a, b], (a, b)) and not _C.same_objects([a, b], [a, a]) and not _C.same_objects([a], [a, b])
    assert _C.entries_are([{"k": a}, {"k": b}], "k", [a, b]) and not _C.entries_are([{"k": a}], "k", [b])
    assert not _C.entries_are([{}], "k", [a])  # a missing key is not the recorded object
    assert _C.any_none([a, None]) and not _C.any_none((a, b)) and not _C.any_none([])
    with pytest.raises(TypeError, match="dicts\\[0\\]"):
        _C.entries_are([a], "k", [a])
    with pytest.raises(TypeError, match="'seq' must be a list or tuple"):
        _C.any_none(a)
