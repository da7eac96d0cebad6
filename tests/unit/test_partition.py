"""The C partitioner against an independent Python reference, plus the coverage/overlap/alignment
properties, over random groups, bucket caps and world sizes 1..64."""
import random

import pytest
import torch

from deepspeed_c import _C
from deepspeed_c.ops.partition import PartitionPlan


def ceil_to(x, m):
    return -(-x // m) * m


def reference(numels, world, cap, align, order, given=None):
    """Written from the layout's definition, independently of the C code. given: a bucket id per
    parameter instead of the cap."""
    order = list(range(len(numels))) if order is None else list(order)
    buckets = []  # lists of param indices
    for idx in order:
        filled = sum(numels[i] for i in buckets[-1]) if buckets else 0
        if given is not None:
            opens = not buckets or given[idx] != given[buckets[-1][-1]]
        else:
            opens = not buckets or (filled > 0 and filled + numels[idx] > cap)
        if opens:
            buckets.append([])
        buckets[-1].append(idx)
    runtime = []
    bucket_start = 0
    rank_base = 0
    for b, members in enumerate(buckets):
        size = ceil_to(sum(numels[i] for i in members), world * align)
        chunk = size // world
        pos = bucket_start
        for idx in members:
            for e in range(numels[idx]):  # element by element: obviously right, slow but small inputs
                rel = pos + e - bucket_start
                runtime.append((idx, e, rel // chunk, rank_base + rel % chunk, b))
            pos += numels[idx]
        bucket_start += size
        rank_base += chunk
    total = sum(numels)
    ds_total = ceil_to(total, world * align)
    part = ds_total // world
    ds = []
    off = 0
    for idx, n in enumerate(numels):
        for e in range(n):
            ds.append((idx, e, (off + e) // part, (off + e) % part, 0))
        off += n
    return runtime, ds, bucket_start // world if buckets else 0, part


def expand(slices):
    """(param, rank, pstart, lstart, length, bucket) rows -> per-element tuples like reference()."""
    out = []
    for param, rank, pstart, lstart, length, bucket in slices:
        for k in range(length):
            out.append((param, pstart + k, rank, lstart + k, bucket))
    return sorted(out)


@pytest.mark.parametrize("seed", range(60))
def test_matches_reference_and_properties(seed):
    rng = random.Random(seed)
    world = rng.choice([1, 2, 3, 4, 7, 8, 16, 64]) if seed % 3 else rng.randint(1, 64)
    n = rng.randint(0, 12)
    numels = [rng.choice([0, 1, 2, 3, 5, 17, 64, 100, 333]) for _ in range(n)]
    cap = rng.choice([1, 7, 64, 200, 10_000])
    align = rng.choice([1, 2, 4])
    order = list(range(n))
    if rng.random() < 0.5:
        order.reverse()
    elif rng.random() < 0.5:
        rng.shuffle(order)
    plan = PartitionPlan.build(numels, world, cap, align, order)
    ref_runtime, ref_ds, ref_rt_part, ref_ds_part = reference(numels, world, cap, align, order)
    assert expand(plan.slices("runtime")) == sorted(
        (p, e, r, loc, b) for p, e, r, loc, b in ref_runtime)
    assert expand(plan.slices("deepspeed")) == sorted(ref_ds)
    assert plan.runtime_partition_size == ref_rt_part and plan.ds_partition_size == ref_ds_part
    for layout in ("runtime", "deepspeed"):
        size = plan.partition_size(layout)
        seen = set()
        for param, rank, pstart, lstart, length, _ in plan.slices(layout):
            assert 0 <= rank < world and 0 <= lstart and lstart + length <= size
            for k in range(length):  # no overlap anywhere
                assert (rank, lstart + k) not in seen
                seen.add((rank, lstart + k))
        assert len(seen) == sum(numels)  # exact cover of every element
    for b, size in enumerate(plan.bucket_size):
        assert size % (world * align) == 0 and plan.bucket_offset[b] % (world * align) == 0
        assert plan.bucket_numel[b] <= size
    assert plan.ds_total % (world * align) == 0


@pytest.mark.parametrize("seed", range(30))
def test_given_buckets_match_reference(seed):
    """Buckets given per parameter (ZeRO-3's module-aligned buckets), any sizes, instead of a cap."""
    rng = random.Random(1000 + seed)
    world = rng.choice([1, 2, 3, 4, 8])
    n = rng.randint(1, 12)
    numels = [rng.choice([0, 1, 3, 17, 64, 333]) for _ in range(n)]
    align = rng.choice([1, 2])
    order = list(range(n))
    rng.shuffle(order)
    given, b = [0] * n, 0
    for pos, idx in enumerate(order):  # contiguous runs along the order, numbered 0, 1, ...
        if pos > 0 and rng.random() < 0.4:
            b += 1
        given[idx] = b
    plan = PartitionPlan.build(numels, world, 1, align, order, param_bucket=given)
    assert list(plan.param_bucket) == given
    ref_runtime, ref_ds, ref_rt_part, ref_ds_part = reference(numels, world, 1, align, order, given)
    assert expand(plan.slices("runtime")) == sorted(ref_runtime)
    assert expand(plan.slices("deepspeed")) == sorted(ref_ds)
    assert plan.runtime_partition_size == ref_rt_part and plan.ds_partition_size == ref_ds_part
    # the cap-cut buckets, handed back as given buckets, give the same plan
    cut = PartitionPlan.build(numels, world, 50, align, order)
    again = PartitionPlan.build(numels, world, 1, align, order, param_bucket=list(cut.param_bucket))
    assert again.param_offset == cut.param_offset and torch.equal(again.runtime_slices, cut.runtime_slices)


def test_given_buckets_must_be_contiguous_runs():
    with pytest.raises(ValueError, match="param_bucket must number the buckets"):
        PartitionPlan.build([4, 4, 4], 2, 1, 2, [0, 1, 2], param_bucket=[0, 1, 0])
    with pytest.raises(ValueError, match="param_bucket must number the buckets"):
        PartitionPlan.build([4, 4], 2, 1, 2, [0, 1], param_bucket=[1, 2])
    with pytest.raises(ValueError, match="param_bucket has 1 entries"):
        PartitionPlan.build([4, 4], 2, 1, 2, [0, 1], param_bucket=[0])


def test_round_trips_between_layouts_and_world_sizes():
    numels = [37, 5, 0, 1000, 3, 129]
    params = [torch.randn(n, dtype=torch.float64) for n in numels]
    src = PartitionPlan.build(numels, 4, 256, 2, order := list(reversed(range(len(numels)))))
    runtime_parts = [src.scatter_params(params, "runtime", r) for r in range(4)]
    for got, want in zip(src.gather_params(runtime_parts, "runtime"), params):
        assert torch.equal(got, want)
    for world in (1, 2, 3, 8):
        dst = PartitionPlan.build(numels, world, 100, 2)
        ds_parts = src.convert(runtime_parts, "runtime", "deepspeed", dst)
        assert all(p.numel() == dst.ds_partition_size for p in ds_parts)
        flat = torch.cat(ds_parts)
        assert torch.equal(flat[:sum(numels)], torch.cat(params))
        assert torch.count_nonzero(flat[sum(numels):]) == 0  # padding is zeros
        back = dst.convert(ds_parts, "deepspeed", "runtime", src)
        for a, b in zip(back, runtime_parts):
            assert torch.equal(a, b)


def test_bad_arguments_raise_named_errors():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        _C.partition_plan([1], 0, 10, 2)
    with pytest.raises(ValueError, match="bucket_cap must be >= 1"):
        _C.partition_plan([1], 2, 0, 2)
    with pytest.raises(ValueError, match=r"numels\[1\] must be >= 0"):
        _C.partition_plan([1, -3], 2, 10, 2)
    with pytest.raises(TypeError, match=r"'numels\[0\]' must be an int"):
        _C.partition_plan([1.5], 2, 10, 2)
    with pytest.raises(ValueError, match="permutation"):
        _C.partition_plan([1, 2], 2, 10, 2, [0, 0])
    with pytest.raises(ValueError, match="runtime_order has 1 entries"):
        _C.partition_plan([1, 2], 2, 10, 2, [0])
    with pytest.raises(TypeError, match="'numels' must be a list"):
        _C.partition_plan(None, 2, 10, 2)
    plan = PartitionPlan.build([4, 4], 2, 8)
    with pytest.raises(ValueError, match="partition 1 has 3 elements"):
        plan.gather_params([torch.zeros(4), torch.zeros(3)], "runtime")
