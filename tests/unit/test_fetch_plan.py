"""The ZeRO-3 fetch planner (csrc/core/fetch_plan.c) against an independent Python executor of its
contract (csrc/include/dsc/fetch_plan.h): plans are run step by step and every guarantee, and the
greediness of prefetch and reuse, is checked from the trace alone."""
from __future__ import annotations

import os
import random
import shutil
import subprocess

import pytest

from deepspeed_c import _C
from deepspeed_c.ops.fetch_plan import FetchPlan

BIG = 10**12


def build(steps, numels, persistent=None, bucket=0, max_live=BIG, reuse=0, min_batch=0):
    return FetchPlan.build(steps, numels, persistent, prefetch_bucket_size=bucket, max_live_parameters=max_live,
                           max_reuse_distance=reuse, min_prefetch_batch=min_batch)


def plan_lists(plan):
    return ([plan.fetch_at(i) for i in range(plan.num_steps)], [plan.release_at(i) for i in range(plan.num_steps)])


def check_plan(plan, steps, numels, persistent, bucket, max_live, reuse, min_batch=0):
    """Executes `plan` over the trace and asserts invariants 1-5 plus the documented greedy rules.
    Returns the peak live non-persistent numel."""
    S, U = len(steps), len(numels)
    pers = list(persistent) if persistent is not None else [False] * U
    size = lambda units: sum(numels[u] for u in units if not pers[u])  # noqa: E731
    own = [size(s) for s in steps]
    cap = [max(max_live, o) for o in own]

    def next_use(u, after):
        return next((j for j in range(after + 1, S) if u in steps[j]), None)

    def distance(i, j):  # every use counts (DeepSpeed's walk over its module order)
        return sum(numels[w] for m in range(i + 1, j) for w in steps[m])

    assert plan.num_steps == S
    live: set[int] = set()
    pins: dict[int, tuple[int, int]] = {}   # unit -> (prefetch step, target step), until used
    intervals: list[tuple[int, int, int]] = []  # every pin ever made: (p, k, numel)
    fetched_persistent: set[int] = set()
    peak = 0
    for i, step in enumerate(steps):
        assert plan.step_cap(i) == cap[i]
        groups = plan.fetch_at(i)
        # 5: group 0 is exactly the step's missing units, in trace order; then non-empty groups
        assert len(groups) >= 1
        assert groups[0] == [u for u in step if u not in live], (i, groups)
        limit = max(bucket, 1)
        for g in groups[1:]:
            assert g, f"step {i}: empty prefetch group"
            assert len(g) == 1 or sum(numels[u] for u in g) <= limit, (i, g)
        for u in groups[0]:
            assert u not in live
            live.add(u)
            if pers[u]:
                assert u not in fetched_persistent
                fetched_persistent.add(u)
            assert size(live) <= cap[i], f"step {i}: live {size(live)} > cap {cap[i]}"
        # 1: the step's units are all live before any prefetch
        assert set(step) <= live
        for u in step:
            pins.pop(u, None)
        after_own = set(live)
        # 4: prefetch; re-walk the window and check each prefetched unit is the walk's next pick
        prefetched = [u for g in groups[1:] for u in g]
        if bucket == 0 or i == S - 1:
            assert not prefetched
        order, seen = [], set(step)
        for k in range(i + 1, S):
            for u in steps[k]:
                if u not in seen:
                    seen.add(u)
                    order.append((u, k))
        pin_at = {}  # step m -> numel pinned there by pins already made (not in S_m)
        for p, k, v in intervals:
            if p < i < k:
                for m in range(i + 1, k):
                    pin_at[m] = pin_at.get(m, 0) + v
        # the greedy walk, dry: what a plan without batching prefetches here, and why the walk stopped
        window, dry_live, dry_pin, picks, stop = 0, set(live), dict(pin_at), [], "end"
        for u, k in order if bucket else []:  # prefetch_bucket_size 0: no walk
            v = numels[u]
            if pers[u] and u in after_own:
                continue
            if u in after_own:
                if window + v > bucket:
                    stop = "window"
                    break
                window += v
                continue
            if window + v > bucket:
                stop = "window"
                break
            if not (pers[u] or (size(dry_live) + v <= max_live and
                                all(own[m] + dry_pin.get(m, 0) + v <= cap[m] for m in range(i + 1, k)))):
                stop = "max_live"
                break
            picks.append((u, k))
            dry_live.add(u)
            if not pers[u]:
                for m in range(i + 1, k):
                    dry_pin[m] = dry_pin.get(m, 0) + v
            window += v
        if picks and not prefetched:
            # batching held them back: only while the window is full, for less than min_batch, none for i + 1
            assert min_batch > 0 and stop == "window", f"step {i}: {picks} fit the window but were not prefetched"
            assert sum(numels[u] for u, _ in picks) < min_batch, f"step {i}: held back {picks} >= min_batch"
            assert picks[0][1] > i + 1, f"step {i}: held back unit {picks[0][0]} needed by the next step"
        else:
            assert prefetched == [u for u, _ in picks], f"step {i}: prefetched {prefetched}, the walk picks {picks}"
        for u in prefetched:
            k = dict(picks)[u]
            live.add(u)
            if pers[u]:
                fetched_persistent.add(u)
            else:
                pins[u] = (i, k)
                intervals.append((i, k, numels[u]))
            assert size(live) <= max(max_live, own[i]), f"step {i}: prefetch over max_live"
        if own[i] > max_live:
            assert not [u for u in prefetched if not pers[u]], f"step {i} is over max_live but prefetched"
        assert plan.live_numel_after_fetch(i) == size(live)
        peak = max(peak, size(live))
        # 3: releases
        rel = plan.release_at(i)
        assert rel == sorted(rel)
        for u in rel:
            assert u in live and not pers[u], (i, u)
            assert u not in pins, f"step {i}: released unit {u} prefetched for step {pins.get(u)}"
            live.discard(u)
        assert plan.live_numel_after_release(i) == size(live)
        kept = {u for u in live if not pers[u]}
        if i == S - 1:
            assert not kept, f"units {sorted(kept)} live after the last step"
            break
        # reuse: every kept unit is pinned or within reuse distance of its next use
        for u in kept:
            if u in pins:
                continue
            j = next_use(u, i)
            assert j is not None and distance(i, j) <= reuse, f"step {i}: kept {u} (next use {j})"
        # greedy: a released unit eligible for reuse did not fit cap(i + 1)
        nxt = set(steps[i + 1])
        held = size(kept | nxt)
        assert held <= cap[i + 1]
        for u in rel:
            j = next_use(u, i)
            if j is not None and distance(i, j) <= reuse:
                assert u not in nxt and held + numels[u] > cap[i + 1], f"step {i}: released {u} though it fit"
    assert not pins
    assert plan.peak_live_numel == peak
    return peak


# ---------------------------------------------------------------- hand-written plans


def test_sequential_units_without_prefetch():
    plan = build([[0], [1], [2]], [10, 10, 10])
    assert plan_lists(plan) == ([[[0]], [[1]], [[2]]], [[0], [1], [2]])
    assert plan.peak_live_numel == 10


def test_prefetch_of_the_next_unit_goes_in_a_second_group():
    plan = build([[0], [1], [2]], [10, 10, 10], bucket=10)
    assert plan_lists(plan) == ([[[0], [1]], [[], [2]], [[]]], [[0], [1], [2]])
    assert [plan.live_numel_after_fetch(i) for i in range(3)] == [20, 20, 10]
    assert plan.peak_live_numel == 20


def test_prefetch_window_holds_one_bucket_ahead():
    # bucket 20: step 0 takes units 1 and 2 ahead; step 1 sees 2 already in its window and adds 3
    plan = build([[0], [1], [2], [3], [4]], [10] * 5, bucket=20)
    fetch, release = plan_lists(plan)
    assert fetch == [[[0], [1, 2]], [[], [3]], [[], [4]], [[]], [[]]]
    assert release == [[0], [1], [2], [3], [4]]


def test_prefetch_stops_at_max_live():
    plan = build([[0], [1], [2]], [10, 10, 10], bucket=100, max_live=20)
    assert plan_lists(plan)[0] == [[[0], [1]], [[], [2]], [[]]]
    assert plan.peak_live_numel == 20


def test_prefetch_stops_at_the_first_unit_over_the_bucket():
    # unit 1 (50) does not fit a bucket of 30: the walk stops there, unit 2 is not taken past it
    plan = build([[0], [1], [2]], [10, 50, 5], bucket=30)
    assert plan_lists(plan)[0] == [[[0]], [[1], [2]], [[]]]


def test_prefetch_waits_for_room_under_max_live():
    # step 0 takes unit 1 ahead (10 + 80 <= 100); unit 2 (50) never fits beside unit 1, so it is
    # fetched by its own step
    steps, numels = [[0], [1], [2]], [10, 80, 50]
    plan = build(steps, numels, bucket=200, max_live=100)
    assert plan_lists(plan) == ([[[0], [1]], [[]], [[2]]], [[0], [1], [2]])
    assert plan.peak_live_numel == 90
    check_plan(plan, steps, numels, None, 200, 100, 0)


def test_forward_backward_reuse_distance():
    steps = [[0], [1], [2], [2], [1], [0]]
    # distance 20 keeps unit 1 across steps 2-3 (unit 2 used twice in between: 20, each use counting, as
    # DeepSpeed counts); unit 0 (40 between) is released
    plan = build(steps, [10, 10, 10], reuse=20)
    assert plan_lists(plan) == ([[[0]], [[1]], [[2]], [[]], [[]], [[0]]], [[0], [], [], [2], [1], [0]])
    # at 10 unit 1 is released too: the second use of unit 2 counts again
    plan = build(steps, [10, 10, 10], reuse=10)
    assert plan_lists(plan) == ([[[0]], [[1]], [[2]], [[]], [[1]], [[0]]], [[0], [1], [], [2], [1], [0]])
    # distance 0 keeps only what the very next step needs
    plan = build(steps, [10, 10, 10], reuse=0)
    assert plan_lists(plan) == ([[[0]], [[1]], [[2]], [[]], [[1]], [[0]]], [[0], [1], [], [2], [1], [0]])
    # max_live 15 leaves no room to keep unit 1 beside unit 2
    plan = build(steps, [10, 10, 10], max_live=15, reuse=20)
    assert plan_lists(plan) == ([[[0]], [[1]], [[2]], [[]], [[1]], [[0]]], [[0], [1], [], [2], [1], [0]])
    assert plan.peak_live_numel == 10


def test_persistent_units_are_fetched_once_and_never_released():
    steps = [[0, 1], [1], [2], [0]]
    plan = build(steps, [5, 10, 10], persistent=[True, False, False])
    fetch, release = plan_lists(plan)
    assert fetch == [[[0, 1]], [[]], [[2]], [[]]]
    assert release == [[], [1], [2], []]
    assert plan.peak_live_numel == 10  # persistent elements are not counted


def test_step_over_max_live_prefetches_and_keeps_nothing_extra():
    steps = [[0], [1, 2], [3], [0]]
    plan = build(steps, [10, 60, 60, 10], bucket=1000, max_live=50, reuse=BIG)
    fetch, release = plan_lists(plan)
    assert plan.step_cap(1) == 120
    assert fetch[1] == [[1, 2]]  # nothing prefetched at the oversized step
    assert 0 in release[0]  # unit 0 cannot stay beside step 1's 120
    check_plan(plan, steps, [10, 60, 60, 10], None, 1000, 50, BIG)


def test_prefetches_coalesce_into_one_group():
    # the window holds at most one bucket, so the prefetches of a step fit one group of <= bucket
    plan = build([[0, 1, 2], [3], [4], [5]], [1, 1, 1, 4, 3, 2], bucket=7)
    assert plan.fetch_at(0) == [[0, 1, 2], [3, 4]]
    assert plan.fetch_at(1) == [[], [5]]


def test_batched_prefetch_waits_for_a_larger_group():
    # a chain of equal units, window 4 units, batch 2 units: after the first fill, the one unit that
    # enters the window at step 1 waits and goes out with the next one at step 2; the tail of the trace
    # (the walk reaches its end) is not held back
    steps, numels = [[u] for u in range(8)], [10] * 8
    plan = build(steps, numels, bucket=40, min_batch=20)
    assert [plan.fetch_at(i) for i in range(4)] == [[[0], [1, 2, 3, 4]], [[]], [[], [5, 6]], [[], [7]]]
    check_plan(plan, steps, numels, None, 40, BIG, 0, min_batch=20)
    greedy = build(steps, numels, bucket=40)
    assert [greedy.fetch_at(i) for i in range(4)] == [[[0], [1, 2, 3, 4]], [[], [5]], [[], [6]], [[], [7]]]
    assert sum(len(plan.fetch_at(i)) for i in range(8)) < sum(len(greedy.fetch_at(i)) for i in range(8))


def test_batched_prefetch_never_holds_back_the_next_steps_unit():
    # step 1 needs unit 2 which only the walk at step 0 can prefetch: the batch limit does not hold it back
    steps, numels = [[0, 1], [2], [3]], [30, 30, 5, 5]
    plan = build(steps, numels, bucket=8, min_batch=100)
    assert plan.fetch_at(0) == [[0, 1], [2]]
    check_plan(plan, steps, numels, None, 8, BIG, 0, min_batch=100)


def test_batched_prefetch_rejects_a_negative_batch():
    with pytest.raises(ValueError, match="min_prefetch_batch must be >= 0"):
        build([[0]], [1], bucket=1, min_batch=-1)


@pytest.mark.parametrize("seed", range(200))
def test_random_traces_batched_keep_every_invariant(seed):
    rng = random.Random(10_000 + seed)
    steps, numels, persistent = random_trace(rng)
    bucket = rng.choice([1, 10, 60, 150, 500, BIG])
    max_live = rng.choice([0, 50, 200, 1000, BIG])
    reuse = rng.choice([0, 100, BIG])
    min_batch = rng.choice([1, bucket // 2, bucket, BIG])
    plan = build(steps, numels, persistent, bucket, max_live, reuse, min_batch)
    check_plan(plan, steps, numels, persistent, bucket, max_live, reuse, min_batch)


def test_empty_trace_and_empty_steps():
    assert build([], [1, 2]).num_steps == 0
    plan = build([[], [0], []], [3])
    assert plan_lists(plan) == ([[[]], [[0]], [[]]], [[], [0], []])


def test_limits_of_zero():
    steps = [[0], [1], [0, 1]]
    plan = build(steps, [4, 4], bucket=0, max_live=0, reuse=0)
    # unit 1 is needed by the very next step: distance 0, no extra room, so it is kept
    assert plan_lists(plan) == ([[[0]], [[1]], [[0]]], [[0], [], [0, 1]])
    check_plan(plan, steps, [4, 4], None, 0, 0, 0)


def test_deterministic():
    rng = random.Random(3)
    steps = [rng.sample(range(12), rng.randint(0, 4)) for _ in range(40)]
    numels = [rng.choice([1, 10, 100]) for _ in range(12)]
    a = build(steps, numels, bucket=150, max_live=300, reuse=200)
    b = build(steps, numels, bucket=150, max_live=300, reuse=200)
    assert plan_lists(a) == plan_lists(b)


# ---------------------------------------------------------------- random traces


def random_trace(rng):
    U = rng.randint(1, 30)
    numels = [rng.choice([0, 1, 5, 10, 50, 100, 1000]) for _ in range(U)]
    persistent = [rng.random() < 0.15 for _ in range(U)] if rng.random() < 0.6 else None
    kind = rng.random()
    if kind < 0.4:  # a model: modules with 1-3 units (some shared), forward then reversed backward
        mods = [rng.sample(range(U), rng.randint(1, min(3, U))) for _ in range(rng.randint(1, 15))]
        steps = mods + mods[::-1]
        if rng.random() < 0.3:
            steps = steps * 2
    elif kind < 0.8:
        steps = [rng.sample(range(U), rng.randint(0, min(5, U))) for _ in range(rng.randint(0, 40))]
    else:  # heavy repetition of few units
        steps = [rng.sample(range(min(U, 4)), rng.randint(1, min(U, 4))) for _ in range(rng.randint(1, 30))]
    return steps, numels, persistent


@pytest.mark.parametrize("seed", range(400))
def test_random_traces_keep_every_invariant(seed):
    rng = random.Random(seed)
    steps, numels, persistent = random_trace(rng)
    bucket = rng.choice([0, 0, 1, 10, 60, 150, 500, BIG])
    max_live = rng.choice([0, 1, 50, 200, 1000, BIG])
    reuse = rng.choice([0, 10, 100, 1000, BIG])
    plan = build(steps, numels, persistent, bucket, max_live, reuse)
    check_plan(plan, steps, numels, persistent, bucket, max_live, reuse)


def test_huge_limits_gather_everything_up_front():
    rng = random.Random(11)
    for _ in range(30):
        steps, numels, persistent = random_trace(rng)
        plan = build(steps, numels, persistent, bucket=BIG, max_live=BIG, reuse=BIG)
        check_plan(plan, steps, numels, persistent, BIG, BIG, BIG)
        if steps:
            used = {u for s in steps for u in s}
            assert {u for g in plan.fetch_at(0) for u in g} == used
            assert all(plan.fetch_at(i) == [[]] for i in range(1, len(steps)))


def test_the_checker_catches_a_broken_plan():
    """The executor must fail on plans that break the contract (else it proves nothing)."""
    steps, numels = [[0], [1], [0]], [10, 10]
    good = build(steps, numels, reuse=10)
    check_plan(good, steps, numels, None, 0, BIG, 10)

    class Tampered:
        def __init__(self, base, fetch=None, release=None):
            self.base, self.fetch, self.release = base, fetch or {}, release or {}
            self.num_steps, self.peak_live_numel = base.num_steps, base.peak_live_numel

        def fetch_at(self, i):
            return self.fetch.get(i, self.base.fetch_at(i))

        def release_at(self, i):
            return self.release.get(i, self.base.release_at(i))

        def __getattr__(self, name):
            return getattr(self.base, name)

    bad_plans = [
        Tampered(good, fetch={2: [[]]}, release={0: [0]}),  # unit 0 missing at step 2
        Tampered(good, release={2: [1]}),  # unit 0 live after the end
        Tampered(good, release={0: [0]}),  # released, then used without a fetch
        Tampered(good, fetch={1: [[1], [0]]}),  # fetched while live
    ]
    for bad in bad_plans:
        with pytest.raises(AssertionError):
            check_plan(bad, steps, numels, None, 0, BIG, 10)
    # over the cap: keeping unit 0 beside unit 1 under max_live 10 is illegal
    with pytest.raises(AssertionError):
        check_plan(good, steps, numels, None, 0, 10, 10)


# ---------------------------------------------------------------- bad input


def test_unit_out_of_range_names_the_step():
    with pytest.raises(ValueError, match=r"steps\[3\] names unit 17, but there are 10 units"):
        build([[0], [1], [2], [17]], [1] * 10)
    with pytest.raises(ValueError, match=r"steps\[0\] names unit -1"):
        build([[-1]], [1])


def test_duplicate_unit_in_a_step():
    with pytest.raises(ValueError, match=r"steps\[1\] names unit 4 twice"):
        build([[0], [4, 2, 4]], [1] * 5)


def test_negative_numel_and_limits():
    with pytest.raises(ValueError, match=r"numels\[1\] must be >= 0, got -3"):
        build([[0]], [1, -3])
    for kw in ("prefetch_bucket_size", "max_live_parameters", "max_reuse_distance"):
        args = dict(prefetch_bucket_size=0, max_live_parameters=10, max_reuse_distance=0)
        args[kw] = -1
        with pytest.raises(ValueError, match=kw):
            FetchPlan.build([[0]], [1], None, **args)


def test_wrong_types_and_lengths():
    with pytest.raises(TypeError, match=r"steps\[1\]\[0\] must be an int"):
        build([[0], ["a"]], [1])
    with pytest.raises(TypeError, match=r"steps\[0\] must be a list"):
        _C.fetch_plan([3], [1], None, 0, 0, 0)
    with pytest.raises(TypeError, match="numels"):
        _C.fetch_plan([[0]], 5, None, 0, 0, 0)
    with pytest.raises(ValueError, match="persistent has 1 entries but numels has 2"):
        build([[0]], [1, 2], persistent=[True])
    with pytest.raises(TypeError, match="max_live_parameters must be an int"):
        _C.fetch_plan([[0]], [1], None, 0, 1.5, 0)
    with pytest.raises(TypeError, match="takes 6 or 7 arguments"):
        _C.fetch_plan([[0]], [1])


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the sanitizer driver")
def test_planner_clean_under_sanitizers_and_failed_allocations(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    flags = ["-std=c11", "-g", "-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-Wall",
             "-Wextra", "-Werror", f"-I{root}/csrc/include"]
    obj = tmp_path / "fetch_plan.o"
    subprocess.run(["gcc", *flags, "-include", f"{root}/tests/unit/csrc/fetch_plan_fail_alloc.h", "-c",
                    f"{root}/csrc/core/fetch_plan.c", "-o", str(obj)], check=True, capture_output=True)
    exe = tmp_path / "fetch_plan_fuzz"
    subprocess.run(["gcc", *flags, f"{root}/tests/unit/csrc/fetch_plan_fuzz.c", str(obj), "-o", str(exe)],
                   check=True, capture_output=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
