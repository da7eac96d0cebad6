"""The C bucket planner against an independent Python model of its contract."""
from __future__ import annotations

import random

import pytest

from deepspeed_c import _C
from deepspeed_c.runtime.bucket_plan import BucketPlan


def reference_plan(numels, cap, order=None, keys=None, align=1, first_cap=0):
    """Per-key buckets filled in arrival order; as in DeepSpeed's bucketing, a bucket is closed as
    soon as it holds more than cap elements."""
    n = len(numels)
    order = list(range(n - 1, -1, -1)) if order is None else list(order)
    keys = [0] * n if keys is None else list(keys)
    up = lambda v: (v + align - 1) // align * align  # noqa: E731
    open_b: dict[int, list] = {}
    bucket_of, offset_of, numel_b, key_b, members = [0] * n, [0] * n, [], [], []
    for i in order:
        k = keys[i]
        cur = open_b.get(k)
        if cur is None:
            cur = [len(numel_b), 0]
            numel_b.append(0)
            key_b.append(k)
            members.append([])
            open_b[k] = cur
        at = up(cur[1])
        bucket_of[i], offset_of[i] = cur[0], at
        members[cur[0]].append(i)
        cur[1] = at + numels[i]
        numel_b[cur[0]] = up(cur[1])
        limit = first_cap if cur[0] == 0 and 0 < first_cap < cap else cap
        if cur[1] > limit:
            del open_b[k]
    return bucket_of, offset_of, numel_b, key_b, members


@pytest.mark.parametrize("seed", range(20))
def test_layout_matches_reference(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    numels = [rng.choice([0, 1, 3, 7, 64, 100, 1000]) for _ in range(n)]
    cap = rng.choice([1, 50, 128, 1000, 5000])
    order = list(range(n))
    rng.shuffle(order)
    use_order = rng.random() < 0.5
    keys = [rng.randint(0, 2) for _ in range(n)] if rng.random() < 0.5 else None
    align = rng.choice([1, 4, 16])
    first_cap = rng.choice([0, 1, 30, 10**6])
    plan = BucketPlan(numels, cap, order=order if use_order else None, keys=keys, align=align, first_cap=first_cap)
    ref = reference_plan(numels, cap, order if use_order else None, keys, align, first_cap)
    got = plan.layout
    assert (got.bucket_of, got.offset_of, got.bucket_numels, got.bucket_keys, got.members) == tuple(ref)
    # invariants: aligned, non-overlapping slots inside their buffer, one key per bucket
    for b, members in enumerate(got.members):
        spans = sorted((got.offset_of[i], got.offset_of[i] + numels[i]) for i in members)
        assert all(s % align == 0 for s, _ in spans)
        assert all(a[1] <= b_[0] for a, b_ in zip(spans, spans[1:]))
        assert spans[-1][1] <= got.bucket_numels[b]
        assert len({(keys or [0] * n)[i] for i in members}) == 1
        # all but the last member fit under the cap: the last one is what closed the bucket
        assert got.offset_of[members[-1]] <= cap + align


def test_default_order_is_reverse_registration():
    plan = BucketPlan([10, 20, 30, 40], cap=50)
    assert plan.layout.members == [[3, 2], [1, 0]]
    assert plan.layout.offset_of == [20, 0, 40, 0]
    assert plan.layout.bucket_numels == [70, 30]


@pytest.mark.parametrize("seed", range(10))
def test_readiness_frontier_is_in_bucket_order(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 30)
    numels = [rng.randint(1, 50) for _ in range(n)]
    plan = BucketPlan(numels, cap=60)
    members = plan.layout.members
    arrival = list(range(n))
    rng.shuffle(arrival)
    remaining = [len(m) for m in members]
    launched = 0
    plan.reset()
    for i in arrival:
        remaining[plan.layout.bucket_of[i]] -= 1
        expected = 0
        while expected < len(members) and remaining[expected] == 0:
            expected += 1
        assert plan.mark(i) == expected
        assert expected >= launched
        launched = expected
    assert launched == plan.num_buckets
    assert plan.arrival() == arrival
    assert plan.pending() == []


@pytest.mark.parametrize("seed", range(20))
def test_given_buckets_readiness(seed):
    """assignment= (the ZeRO partition plans' buckets): the frontier is the first bucket with a
    member still missing, whatever order gradients arrive in; offsets follow the arrival order."""
    rng = random.Random(500 + seed)
    n = rng.randint(1, 25)
    numels = [rng.randint(0, 40) for _ in range(n)]
    nb = rng.randint(1, n)
    assignment = list(range(nb)) + [rng.randrange(nb) for _ in range(n - nb)]
    rng.shuffle(assignment)
    plan = BucketPlan(numels, 1, assignment=assignment)
    assert plan.layout.bucket_of == assignment and plan.num_buckets == nb
    for b in range(nb):
        members = [i for i in range(n - 1, -1, -1) if assignment[i] == b]  # default order: reverse
        assert plan.layout.members[b] == members
        assert [plan.layout.offset_of[i] for i in members] == [sum(numels[j] for j in members[:k])
                                                              for k in range(len(members))]
    arrival = list(range(n))
    rng.shuffle(arrival)
    remaining = [assignment.count(b) for b in range(nb)]
    plan.reset()
    for i in arrival:
        remaining[assignment[i]] -= 1
        expected = 0
        while expected < nb and remaining[expected] == 0:
            expected += 1
        assert plan.mark(i) == expected
    with pytest.raises(ValueError, match="bucket_of must number the buckets"):
        BucketPlan([1, 2], 1, assignment=[0, 2])
    with pytest.raises(ValueError, match="assignment has 1 entries"):
        BucketPlan([1, 2], 1, assignment=[0])


def test_mark_all_and_pending_and_reset():
    plan = BucketPlan([5, 5, 5, 5], cap=9)  # buckets [3,2] and [1,0]
    plan.reset()
    assert plan.mark(3) == 0
    assert sorted(plan.pending()) == [0, 1, 2]
    assert plan.pending() == [2, 1, 0]
    assert plan.mark_all() == 2
    assert plan.arrival() == [3, 2, 1, 0]
    plan.reset()
    assert plan.frontier() == 0 and plan.arrival() == []
    assert plan.mark(1) == 0 and plan.mark(0) == 0 and plan.mark(2) == 0 and plan.mark(3) == 2


def test_errors():
    plan = BucketPlan([1, 2], cap=10)
    plan.reset()
    plan.mark(0)
    with pytest.raises(RuntimeError, match="twice"):
        plan.mark(0)
    with pytest.raises(IndexError, match="out of range"):
        plan.mark(2)
    with pytest.raises(IndexError):
        plan.mark(-1)
    with pytest.raises(ValueError, match="cap"):
        _C.bucket_plan([1], 0)
    with pytest.raises(ValueError, match="numels"):
        _C.bucket_plan([-1], 10)
    with pytest.raises(ValueError, match="permutation"):
        _C.bucket_plan([1, 2], 10, [0, 0])
    with pytest.raises(ValueError, match="order has"):
        _C.bucket_plan([1, 2], 10, [0])
    with pytest.raises(ValueError, match="keys has"):
        _C.bucket_plan([1, 2], 10, None, [0])
    with pytest.raises(ValueError, match="align"):
        _C.bucket_plan([1, 2], 10, None, None, 0)
    with pytest.raises(TypeError, match="numels"):
        _C.bucket_plan("ab", 10)
    with pytest.raises(TypeError, match="first_cap"):
        _C.bucket_plan([1], 10, None, None, 1, "x")
    with pytest.raises(TypeError, match="numels\\[1\\]"):
        _C.bucket_plan([1, 2.5], 10)
    with pytest.raises(TypeError, match="bucket plan"):
        _C.bucket_plan_mark(object(), 0)
    with pytest.raises(TypeError):
        _C.bucket_plan_mark(plan._plan)


def test_empty_plan():
    plan = BucketPlan([], cap=10)
    assert plan.num_buckets == 0
    plan.reset()
    assert plan.mark_all() == 0


def test_small_first_bucket():
    plan = BucketPlan([4, 4, 4, 4, 4], cap=100, first_cap=3)
    assert plan.layout.members == [[4], [3, 2, 1, 0]]


def test_bucket_closes_once_over_cap():
    plan = BucketPlan([5, 100, 5, 3], cap=10)
    assert plan.layout.members == [[3, 2, 1], [0]]
    assert plan.layout.bucket_numels == [108, 5]


@pytest.mark.skipif(__import__("shutil").which("gcc") is None, reason="needs gcc to build the sanitizer driver")
def test_planner_clean_under_address_and_undefined_sanitizers(tmp_path):
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    exe = tmp_path / "bucket_plan_fuzz"
    subprocess.run(["gcc", "-std=c11", "-g", "-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    "-Wall", "-Wextra", "-Werror", f"-I{root}/csrc/include",
                    f"{root}/tests/unit/csrc/bucket_plan_fuzz.c", f"{root}/csrc/core/bucket_plan.c", "-o", str(exe)],
                   check=True, capture_output=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
