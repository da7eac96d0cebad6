"""ops.partition_route: routes between two partition layouts, checked against PartitionPlan.convert (which
gathers whole parameters and re-cuts them) on random parameter sizes, world sizes and bucket caps."""
from __future__ import annotations

import random

import pytest
import torch

from deepspeed_c.ops.partition import PartitionPlan
from deepspeed_c.ops.partition_route import layout_route, route

PAIRS = [("runtime", "deepspeed", False), ("deepspeed", "runtime", False), ("deepspeed", "runtime", True),
         ("runtime", "deepspeed", True)]


def _apply(routes: torch.Tensor, parts: list[torch.Tensor], dst: PartitionPlan, layout: str) -> list[torch.Tensor]:
    out = [torch.zeros(dst.partition_size(layout), dtype=torch.float64) for _ in range(dst.world_size)]
    for s, a, d, b, n in routes.tolist():
        out[d][b:b + n] = parts[s][a:a + n]
    return out


@pytest.mark.parametrize("seed", range(40))
def test_routes_move_what_convert_moves(seed: int) -> None:
    rng = random.Random(seed)
    numels = [rng.choice([0, 1, 3, rng.randint(1, 90)]) for _ in range(rng.randint(1, 9))]
    numels[0] = max(numels[0], 1)
    order = list(range(len(numels)))[::-1] if rng.random() < 0.5 else None
    src_plan = PartitionPlan.build(numels, rng.randint(1, 6), rng.randint(1, 80), 2, order)
    other = PartitionPlan.build(numels, rng.randint(1, 6), rng.randint(1, 80), 2, order)
    g = torch.Generator().manual_seed(seed)
    for src_layout, dst_layout, reshard in PAIRS:
        dst_plan = other if reshard else src_plan
        params = [torch.randn(n, generator=g, dtype=torch.float64) for n in numels]
        parts = [src_plan.scatter_params(params, src_layout, r) for r in range(src_plan.world_size)]
        routes = layout_route(src_plan, src_layout, dst_plan, dst_layout)
        want = src_plan.convert(parts, src_layout, dst_layout, dst_plan=dst_plan)
        got = _apply(routes, parts, dst_plan, dst_layout)
        assert all(torch.equal(w, x) for w, x in zip(want, got)), (numels, src_layout, dst_layout)
        # every element exactly once, and no two consecutive runs that could have been one
        assert int(routes[:, 4].sum()) == sum(numels) and bool((routes[:, 4] > 0).all())
        prev, cur = routes[:-1], routes[1:]
        joinable = ((cur[:, 0] == prev[:, 0]) & (cur[:, 2] == prev[:, 2]) & (cur[:, 1] == prev[:, 1] + prev[:, 4])
                    & (cur[:, 3] == prev[:, 3] + prev[:, 4]))
        assert not bool(joinable.any())


def test_same_layout_is_one_run_per_contiguous_piece() -> None:
    plan = PartitionPlan.build([10, 6, 4], 2, 100, 2)
    routes = layout_route(plan, "deepspeed", plan, "deepspeed")
    assert bool((routes[:, 0] == routes[:, 2]).all()) and bool((routes[:, 1] == routes[:, 3]).all())
    assert routes.shape[0] == 2  # one run per rank: the layout is contiguous on both sides


def test_bad_tables_and_plans_raise() -> None:
    plan = PartitionPlan.build([5, 7], 2, 8, 2)
    gap = plan.ds_slices[1:]  # the first slice missing: the layout no longer covers the group
    with pytest.raises(ValueError, match="source layout's slices do not cover the group's 12 elements"):
        route(plan.numels, gap, plan.runtime_slices)
    with pytest.raises(ValueError, match="partition different parameters"):
        layout_route(plan, "runtime", PartitionPlan.build([5, 8], 2, 8, 2), "deepspeed")
