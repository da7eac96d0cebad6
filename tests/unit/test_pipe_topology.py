"""Topologies (DeepSpeed's documented examples) and layer partitioning: partition_uniform's
boundaries and partition_balanced's optimality (smallest heaviest-minus-lightest spread) against
a brute force over every split; equal to the real DeepSpeed's when DSC_DEEPSPEED_REAL is set."""
from __future__ import annotations

import itertools
import os
import random
import sys

import pytest

from deepspeed_c.runtime.pipe.partition import partition_balanced, partition_uniform
from deepspeed_c.runtime.pipe.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,
                                               ProcessTopology)


def test_documented_examples():
    topo = ProcessTopology(axes=["pipe", "data", "model"], dims=[2, 2, 2])
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_axis_comm_lists("bogus") == []
    X = ProcessTopology(axes=["pipe", "data", "model"], dims=[2, 3, 2])
    assert X.filter_match(pipe=0, data=1) == [2, 3]
    assert [tuple(X.get_coord(r)) for r in X.filter_match(pipe=0, data=1)] == [(0, 1, 0), (0, 1, 1)]
    ab = ProcessTopology(axes=["a", "b"], dims=[2, 2])
    assert ab.get_rank_repr(rank=3) == "a_01-b_01" and ab.get_rank_repr(rank=3, omit_axes=["a"]) == "b_01"
    pd = PipeDataParallelTopology(num_pp=2, num_dp=2)
    assert pd.get_rank(pipe=1, data=0) == 2 and pd.get_coord(3).pipe == 1 and pd.world_size() == 4
    assert pd.get_axis_list("pipe", 1) == [2, 3] and pd.get_dim("model") == 0
    pmd = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert pmd.axes == ["pipe", "data", "model"] and pmd.get_rank(pipe=0, data=1, model=1) == 3
    # last axis fastest, for any axes
    t = ProcessTopology(axes=["x", "y", "z"], dims=[3, 2, 4])
    for r, c in enumerate(itertools.product(range(3), range(2), range(4))):
        assert tuple(t.get_coord(r)) == c and t.get_rank(x=c[0], y=c[1], z=c[2]) == r
    with pytest.raises(ValueError, match="rank 24"):
        t.get_coord(24)
    with pytest.raises(ValueError, match="every axis"):
        t.get_rank(x=0)


def _spread(w, parts):
    sums = [sum(w[parts[i]:parts[i + 1]]) for i in range(len(parts) - 1)]
    return max(sums) - min(sums)


def test_partitions():
    ds = None
    if os.environ.get("DSC_DEEPSPEED_REAL"):
        sys.path[:0] = ["/tmp/ds_real", "/tmp/ds_deps"]
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.runtime import utils as ds
    for n in range(0, 12):
        for m in range(1, 6):
            p = partition_uniform(n, m)
            sizes = [p[i + 1] - p[i] for i in range(m)]
            assert p[0] == 0 and p[-1] == n and (n <= m or max(sizes) - min(sizes) <= 1)
            if ds is not None:
                assert p == ds.partition_uniform(n, m)
    rng = random.Random(3)
    for _ in range(150):
        n, m = rng.randint(2, 9), rng.randint(1, 4)
        w = [rng.choice([0, 1, 2, 5, 48, 72]) for _ in range(n)]
        got = partition_balanced(w, m)
        assert got[0] == 0 and got[-1] == n and all(a <= b for a, b in zip(got, got[1:]))
        if n > m:
            best = min(_spread(w, [0, *c, n]) for c in itertools.combinations(range(1, n), m - 1))
            assert all(got[i] < got[i + 1] for i in range(m)) and _spread(w, got) == best
        if ds is not None:
            assert got == ds.partition_balanced(w, m), (w, m)
    with pytest.raises(ValueError, match="weights\\[1\\]"):
        partition_balanced([1, -2, 3], 2)


def test_prime_factors_rejects_non_positive():
    from math import prod

    from deepspeed_c.runtime.pipe.topology import _prime_factors

    assert _prime_factors(1) == [] and _prime_factors(360) == [2, 2, 2, 3, 3, 5]
    assert all(prod(_prime_factors(n)) == n for n in range(1, 50))
    for bad in (0, -6):
        with pytest.raises(ValueError, match="strictly positive"):
            _prime_factors(bad)
