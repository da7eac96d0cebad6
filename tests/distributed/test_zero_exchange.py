"""checkpoint.zero_exchange on gloo: every rank's partition re-cut into another layout point to point equals
what gathering whole parameters and re-cutting (PartitionPlan.convert) gives; with a tiny round cap (runs
split, many rounds) and a large one, runtime -> DeepSpeed and back, on the default group of 3 ranks and on
a sub-group of ranks {1, 2} (group ranks differ from global ranks there)."""
from __future__ import annotations

import random

import torch

from tests.harness import run_distributed


def _case(seed: int, world: int) -> tuple:
    from deepspeed_c.ops.partition import PartitionPlan

    rng = random.Random(seed)
    numels = [rng.randint(1, 70) for _ in range(rng.randint(1, 7))]
    plan = PartitionPlan.build(numels, world, rng.randint(1, 60), 2, list(range(len(numels)))[::-1])
    g = torch.Generator().manual_seed(seed)
    return plan, [torch.randn(n, generator=g) for n in numels]


def body(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from deepspeed_c.checkpoint.zero_exchange import exchange
    from deepspeed_c.ops.partition_route import layout_route

    failures = []
    sub = dist.new_group([1, 2])
    for group, members in ((None, list(range(world))), (sub, [1, 2])):
        if rank not in members:
            continue
        me, size = members.index(rank), len(members)
        for seed in range(12):
            plan, params = _case(seed, size)
            for src_layout, dst_layout in (("runtime", "deepspeed"), ("deepspeed", "runtime")):
                routes = layout_route(plan, src_layout, plan, dst_layout)
                src = plan.scatter_params(params, src_layout, me)
                want = plan.scatter_params(params, dst_layout, me)
                for cap in (3, 1 << 20):
                    out = torch.zeros(plan.partition_size(dst_layout))
                    exchange(routes, src, out, me, group, cap)
                    if not torch.equal(out, want):
                        failures.append(f"group {members} seed {seed} {src_layout}->{dst_layout} cap {cap}")
    return failures


def test_exchange_matches_convert() -> None:
    assert run_distributed(body, 3, timeout=300) == [[], [], []]
