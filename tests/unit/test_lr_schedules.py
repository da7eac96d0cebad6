"""LR schedules against closed forms written here from the schedules' definitions (float64 math),
plus state-dict round trips, resume semantics and the DeepSpeed constants."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from deepspeed_c.runtime import lr_schedules as ls
from deepspeed_c.runtime.lr_schedules import (LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR)

STEPS = [0, 1, 2, 3, 7, 9, 10, 11, 15, 19, 20, 21, 30, 47, 100]


def _adam(lrs=(0.1, ), betas=(0.9, 0.999)):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.Adam(groups, betas=betas)


def _lrs(opt):
    return [g["lr"] for g in opt.param_groups]


def _warm(i: int, w: int, kind: str) -> float:
    w = max(2, w)
    return math.log(i + 1) / math.log(w) if kind == "log" else i / w


# ---- closed forms ---------------------------------------------------------------------------

def lrrt_ref(i, min_lr, size, rate, stair):
    k = (i + 1) / size
    return min_lr * (1 + rate * (math.floor(k) if stair else k))


def one_cycle_ref(i, lo, hi, first, second, decay_rate, decay_size, stairs1=0, stairs2=None):
    """lr at last_batch_iteration i, from the shape: triangle up over `first`, down over `second`."""
    second = first if second is None else second
    stairs2 = stairs1 if stairs2 is None else stairs2
    total = first + second
    if i < total:
        b = (i + 1) % total  # batches into the current cycle
        if b <= first:
            h = b / first
            if stairs1 > 0:
                h = math.floor(b * stairs1 / first) / stairs1
        else:
            h = (total - b) / second
            if stairs2 > 0:
                h = math.floor((total - b) * stairs2 / second) / stairs2
        return lo + (hi - lo) * h, h
    if decay_size == 0 or decay_rate == 0:
        return lo, None
    k = i - total + 1
    return lo / (1 + decay_rate * k / decay_size), None


def warmup_ref(i, lo, hi, w, kind):
    return lo + (hi - lo) * (_warm(i, w, kind) if i < max(2, w) else 1.0)


def warmup_decay_ref(i, lo, hi, w, total, kind):
    w2 = max(2, w)
    g = _warm(i, w, kind) if i < w2 else max(0.0, (total - i) / max(1, total - w2))
    return lo + (hi - lo) * g


def warmup_cosine_ref(i, base, total, w, min_ratio, cos_min, kind):
    w2 = max(2, w)
    if i < w2:
        r = min_ratio + (1 - min_ratio) * _warm(i, w, kind)
    else:
        p = min(1.0, (i - w2 + 1) / max(1, total - w2))
        r = max(0.0, cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * p)))
    return base * r


# ---- per-schedule checks --------------------------------------------------------------------

@pytest.mark.parametrize("stair", [False, True])
def test_lr_range_test(stair):
    opt = _adam((0.5, 0.5))
    s = LRRangeTest(opt, lr_range_test_min_lr=[1e-3, 2e-3], lr_range_test_step_size=4, lr_range_test_step_rate=0.5,
                    lr_range_test_staircase=stair)
    assert _lrs(opt) == [1e-3, 2e-3]  # the start value is written at construction
    for i in range(max(STEPS) + 1):
        s.step()
        if i in STEPS:
            assert s.last_batch_iteration == i
            assert _lrs(opt) == pytest.approx([lrrt_ref(i, 1e-3, 4, 0.5, stair), lrrt_ref(i, 2e-3, 4, 0.5, stair)],
                                              rel=1e-12)
            assert s.get_last_lr() == _lrs(opt)


@pytest.mark.parametrize("first,second,decay_rate,decay_size,stairs", [
    (10, None, 0.0, 0, 0),
    (10, 6, 0.5, 4, 0),
    (8, 12, 0.1, 3, 0),
    (10, 10, 0.0, 0, 5),
    (6, 9, 0.2, 2, 3),
])
def test_one_cycle_lr_and_momentum(first, second, decay_rate, decay_size, stairs):
    lo, hi, mlo, mhi = 0.01, 0.1, 0.85, 0.95
    opt = _adam((0.3, ))
    s = OneCycle(opt, lo, hi, decay_lr_rate=decay_rate, cycle_first_step_size=first, cycle_second_step_size=second,
                 cycle_first_stair_count=stairs, decay_step_size=decay_size, cycle_min_mom=mlo, cycle_max_mom=mhi,
                 decay_mom_rate=0.05)
    assert _lrs(opt) == [lo]
    assert opt.param_groups[0]["betas"] == (mlo, 0.99)
    total = first + (first if second is None else second)
    for i in range(max(STEPS) + 1):
        s.step()
        lr, h = one_cycle_ref(i, lo, hi, first, second, decay_rate, decay_size, stairs)
        assert opt.param_groups[0]["lr"] == pytest.approx(lr, rel=1e-12, abs=1e-15), i
        beta1 = opt.param_groups[0]["betas"][0]
        if i < total:
            # momentum moves inversely to the lr, between max and min momentum
            assert beta1 == pytest.approx(mhi - (mhi - mlo) * h, rel=1e-12), i
        elif decay_size == 0:
            assert beta1 == pytest.approx(mhi, rel=1e-12)
        else:
            assert beta1 == pytest.approx(mhi * (1 + 0.05 * (i - total + 1) / decay_size), rel=1e-12)
        assert opt.param_groups[0]["betas"][1] == 0.99


def test_one_cycle_peaks_and_valleys():
    opt = _adam()
    s = OneCycle(opt, 0.001, 0.01, cycle_first_step_size=5)
    seen = []
    for _ in range(10):
        s.step()
        seen.append(opt.param_groups[0]["lr"])
    assert max(seen) == pytest.approx(0.01) and seen.index(max(seen)) == 4  # peak after first_step_size batches
    assert seen[-1] == pytest.approx(0.001)


def test_one_cycle_without_betas_disables_momentum():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    s = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=4)
    assert s.cycle_momentum is False and s.get_mom() is None
    s.step()
    assert opt.param_groups[0]["momentum"] == 0.9 and "betas" not in opt.param_groups[0]


def test_one_cycle_per_group_bounds_and_validation():
    opt = _adam((0.1, 0.2))
    s = OneCycle(opt, [0.01, 0.02], [0.1, 0.2], cycle_first_step_size=4)
    s.step(3)
    assert _lrs(opt) == pytest.approx([0.1, 0.2])
    with pytest.raises(ValueError, match="cycle_max_lr"):
        OneCycle(_adam((0.1, 0.2)), 0.01, [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="cycle_first_step_size"):
        OneCycle(_adam(), 0.01, 0.1, cycle_first_step_size=0)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind):
    opt = _adam((0.7, 0.7))
    s = WarmupLR(opt, warmup_min_lr=[0.001, 0.0], warmup_max_lr=0.05, warmup_num_steps=12, warmup_type=kind)
    assert _lrs(opt) == [0.001, 0.0]
    for i in range(max(STEPS) + 1):
        s.step()
        if i in STEPS:
            assert _lrs(opt) == pytest.approx([warmup_ref(i, 0.001, 0.05, 12, kind),
                                               warmup_ref(i, 0.0, 0.05, 12, kind)], rel=1e-12, abs=1e-18)


def test_warmup_lr_defaults_to_each_groups_lr_and_rejects_bad_steps():
    opt = _adam((0.1, 0.2))
    s = WarmupLR(opt, warmup_num_steps=10, warmup_type="linear")
    s.step(20)
    assert _lrs(opt) == pytest.approx([0.1, 0.2])
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupLR(_adam(), warmup_num_steps=0)
    # an unknown warmup_type falls back to log
    s = WarmupLR(_adam(), warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="cubic")
    s.step(4)
    assert s.warmup_type == "log" and s.get_last_lr()[0] == pytest.approx(math.log(5) / math.log(10))


def test_warmup_lr_one_step_warmup_uses_two():
    s = WarmupLR(_adam(), warmup_max_lr=1.0, warmup_num_steps=1)
    s.step()
    assert s.get_last_lr()[0] == pytest.approx(0.0)
    s.step()
    assert s.get_last_lr()[0] == pytest.approx(math.log(2) / math.log(2))


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("total", [40, 5])
def test_warmup_decay_lr(kind, total):
    opt = _adam()
    s = WarmupDecayLR(opt, total_num_steps=total, warmup_min_lr=0.002, warmup_max_lr=0.02, warmup_num_steps=10,
                      warmup_type=kind)
    for i in range(max(STEPS) + 1):
        s.step()
        if i in STEPS:
            assert opt.param_groups[0]["lr"] == pytest.approx(warmup_decay_ref(i, 0.002, 0.02, 10, total, kind),
                                                              rel=1e-12, abs=1e-18), i


def test_warmup_decay_lr_default_max_is_0_001():
    s = WarmupDecayLR(_adam((0.5, )), total_num_steps=100, warmup_num_steps=10, warmup_type="linear")
    s.step(10)
    assert s.get_last_lr() == pytest.approx([0.001 * 90 / 90])


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("total,w", [(30, 10), (8, 10), (12, 1)])
def test_warmup_cosine_lr(kind, total, w):
    opt = _adam((0.3, 0.03))
    s = WarmupCosineLR(opt, total_num_steps=total, warmup_min_ratio=0.1, warmup_num_steps=w, cos_min_ratio=0.05,
                       warmup_type=kind)
    assert _lrs(opt) == [0.0, 0.0]
    for i in range(max(STEPS) + 1):
        s.step()
        if i in STEPS:
            want = [warmup_cosine_ref(i, b, total, w, 0.1, 0.05, kind) for b in (0.3, 0.03)]
            assert _lrs(opt) == pytest.approx(want, rel=1e-12, abs=1e-18), i
            assert s.get_lr_ratio() == pytest.approx(want[0] / 0.3, rel=1e-12)


def test_warmup_cosine_tensor_lr_filled_in_place():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.2))
    lr_tensor = opt.param_groups[0]["lr"]
    s = WarmupCosineLR(opt, total_num_steps=20, warmup_num_steps=4, warmup_type="linear")
    s.step(2)
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert lr_tensor.item() == pytest.approx(0.2 * 2 / 4)


# ---- shared behaviour -----------------------------------------------------------------------

def _make(name, opt, last=-1):
    return {
        "LRRangeTest": lambda: LRRangeTest(opt, lr_range_test_step_size=5, last_batch_iteration=last),
        "OneCycle": lambda: OneCycle(opt, 0.01, 0.1, cycle_first_step_size=5, decay_lr_rate=0.1, decay_step_size=2,
                                     last_batch_iteration=last),
        "WarmupLR": lambda: WarmupLR(opt, warmup_max_lr=0.1, warmup_num_steps=5, last_batch_iteration=last),
        "WarmupDecayLR": lambda: WarmupDecayLR(opt, 20, warmup_num_steps=5, last_batch_iteration=last),
        "WarmupCosineLR": lambda: WarmupCosineLR(opt, 20, warmup_num_steps=5, last_batch_iteration=last),
    }[name]()


@pytest.mark.parametrize("name", ls.VALID_LR_SCHEDULES)
def test_state_dict_round_trip_resumes_the_same_curve(name):
    opt_a = _adam()
    a = _make(name, opt_a)
    for _ in range(7):
        a.step()
    sd = a.state_dict()
    assert sd == {"last_batch_iteration": 6}
    opt_b = _adam()
    b = _make(name, opt_b)
    b.load_state_dict(sd)
    for _ in range(9):
        a.step()
        b.step()
        assert b.get_last_lr() == pytest.approx(a.get_last_lr(), rel=1e-15)
        assert _lrs(opt_b) == pytest.approx(_lrs(opt_a), rel=1e-15)
    assert b.state_dict() == a.state_dict()


@pytest.mark.parametrize("name", ls.VALID_LR_SCHEDULES)
def test_get_last_lr_before_first_step_when_resuming(name):
    opt = _adam((0.123, ))
    s = _make(name, opt, last=4)
    assert _lrs(opt) == [0.123]  # resuming leaves the optimizer alone until step()
    with pytest.raises(AssertionError, match="need to call step"):
        s.get_last_lr()
    s.step()
    assert s.last_batch_iteration == 5
    assert s.get_last_lr() == _lrs(opt)
    assert s.get_lr() == pytest.approx(_lrs(opt))


@pytest.mark.parametrize("name", ls.VALID_LR_SCHEDULES)
def test_step_to_explicit_iteration(name):
    opt_a, opt_b = _adam(), _adam()
    a, b = _make(name, opt_a), _make(name, opt_b)
    for _ in range(13):
        a.step()
    b.step(12)
    assert _lrs(opt_b) == pytest.approx(_lrs(opt_a), rel=1e-15)


def test_wrapped_optimizer_and_bad_optimizer():
    class Wrapper:
        def __init__(self, inner):
            self.optimizer = inner

    opt = _adam()
    s = WarmupLR(Wrapper(opt), warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear")
    s.step(2)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    with pytest.raises(TypeError, match="not a subclass of torch.optim.Optimizer"):
        WarmupLR(object())


def test_constants_match_deepspeed_names():
    assert ls.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert (ls.LR_SCHEDULE, ls.WARMUP_MIN_LR, ls.WARMUP_MAX_LR, ls.WARMUP_NUM_STEPS, ls.WARMUP_TYPE) == (
        "lr_schedule", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type")
    assert (ls.WARMUP_LOG_RATE, ls.WARMUP_LINEAR_RATE, ls.TOTAL_NUM_STEPS, ls.COS_MIN_RATIO) == (
        "log", "linear", "total_num_steps", "cos_min_ratio")
    assert (ls.CYCLE_MIN_LR, ls.CYCLE_MAX_LR, ls.DECAY_STEP_SIZE, ls.CYCLE_FIRST_STEP_SIZE) == (
        "cycle_min_lr", "cycle_max_lr", "decay_step_size", "cycle_first_step_size")


def test_tuning_arguments_and_config_from_args():
    parser = ls.add_tuning_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--lr_schedule", "WarmupLR", "--warmup_num_steps", "50", "--warmup_max_lr", "0.01"])
    config, err = ls.get_config_from_args(args)
    assert err is None
    assert config == {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                                     "warmup_num_steps": 50, "warmup_type": "log"}}
    assert ls.get_lr_from_config(config) == (0.01, "")
    none, why = ls.get_config_from_args(parser.parse_args([]))
    assert none is None and "--lr_schedule" in why
    bad, why = ls.get_config_from_args(parser.parse_args(["--lr_schedule", "Nope"]))
    assert bad is None and "Nope" in why
    one, _ = ls.get_config_from_args(parser.parse_args(["--lr_schedule", "OneCycle"]))
    assert one["params"]["cycle_max_lr"] == 0.1 and one["params"]["cycle_first_step_size"] == 1000
