"""ZeRO-3's unit gather (runtime/zero/unit_gather.py) across real ranks: the units of one fetch go out
as one coalesced collective on the process group, and each unit's output equals the concatenation of
every rank's chunk (checked against an all_gather_object of the chunks). With the comms logger on,
the gathers go through deepspeed_c.comm instead, one logged all_gather_into_tensor per unit, with the
same outputs. A ZeRO-3 engine's plan batches its prefetches, and issues one collective per fetch group.
Runs on gloo (2 and 4 ranks), and on GPUs under DSC_TEST_BACKEND=nccl."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.harness import rank_device, run_distributed

SIZES = (3, 1, 17, 64)  # elements per rank's chunk, one entry per unit


def _body(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    import deepspeed_c.comm as comm
    from deepspeed_c.runtime.zero.unit_gather import UnitGatherer

    dev = rank_device()
    g = torch.Generator().manual_seed(100 + rank)
    chunks = [torch.randn(n, generator=g).to(torch.bfloat16).to(dev) for n in SIZES]
    every: list[Any] = [None] * world
    dist.all_gather_object(every, [c.float().cpu() for c in chunks])
    want = [torch.cat([every[r][u] for r in range(world)]) for u in range(len(SIZES))]
    res: dict[str, Any] = {}
    for logged in (False, True):
        comm.comms_logger.enabled = logged
        comm.comms_logger.prof_all = logged
        comm.comms_logger.reset_data()
        gatherer = UnitGatherer(None)
        outs = [torch.full((n * world,), float("nan"), dtype=torch.bfloat16, device=dev) for n in SIZES]
        gatherer.gather(outs, chunks).wait()
        res[f"equal_{logged}"] = all(torch.equal(o.float().cpu(), w) for o, w in zip(outs, want))
        res[f"collectives_{logged}"] = gatherer.collectives
        raw = comm.comms_logger.get_raw_data().get("all_gather_into_tensor", {}) if logged else {}
        res[f"logged_{logged}"] = sum(v[0] for v in raw.values())  # {size: [count, ...]}
    comm.comms_logger.enabled = False
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_coalesced_unit_gather_matches_every_rank_chunk(world: int) -> None:
    for r in run_distributed(_body, world, timeout=120):
        assert r["equal_False"] and r["equal_True"], r
        assert r["collectives_False"] == 1 and r["collectives_True"] == 1
        assert r["logged_True"] == len(SIZES), r  # one logged gather per unit


LAYERS, WIDTH = 12, 64


def _plan_body(rank: int, world: int) -> dict[str, Any]:
    import deepspeed_c
    from deepspeed_c.ops.fetch_plan import FetchPlan

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    unit = WIDTH * WIDTH
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 0.0,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 4 * unit, "stage3_max_reuse_distance": 0}}
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(rank)).to(rank_device())

    def step() -> None:
        engine.backward(engine(x).pow(2).mean())
        engine.step()

    import deepspeed_c.comm as dc

    # the first step records the trace (its per-step and whole-trace rank checks logged by deepspeed_c.comm),
    # the second follows its plan
    dc.configure(enabled=True, prof_all=True)
    step()
    logged = {name: sum(v[0] for v in by_size.values()) for name, by_size in dc.comms_logger.get_raw_data().items()}
    dc.configure(enabled=False, prof_all=False)
    dc.reset_log()
    step()
    store, coord = engine.optimizer.store, engine.optimizer.coordinator
    before = store.gatherer.collectives
    step()
    plan, trace = coord.plan, coord.plan_trace
    groups = [g for i in range(plan.num_steps) for g in plan.fetch_at(i) if g]
    greedy = FetchPlan.build([list(coord.units[k]) for k, _ in trace], store.unit_numel, store.persistent,
                             **coord.limits)
    greedy_groups = [g for i in range(greedy.num_steps) for g in greedy.fetch_at(i) if g]
    res = {"collectives": store.gatherer.collectives - before, "groups": len(groups),
           "first_groups": len([g for g in plan.fetch_at(0) if g]),
           "greedy_groups": len(greedy_groups), "units": sum(len(g) for g in groups),
           "greedy_units": sum(len(g) for g in greedy_groups), "trace": len(trace),
           "step_checks": logged.get("zero3_step_check", 0), "trace_checks": logged.get("zero3_trace_check", 0)}
    engine.destroy()
    return res


def test_runtime_plan_batches_prefetches_one_collective_per_group() -> None:
    """The plan a ZeRO-3 engine follows batches its prefetches (fewer groups than the greedy plan of the
    same trace, the same units gathered), and each group is one collective; the first step's groups are
    gathered by the previous optimizer step, as one collective, once their chunks are written."""
    for r in run_distributed(_plan_body, 2, timeout=120):
        assert r["first_groups"] >= 1, r
        assert r["collectives"] == r["groups"] - r["first_groups"] + 1, r
        assert r["units"] == r["greedy_units"], r
        assert r["groups"] < r["greedy_groups"], r
        # the recording step's rank checks went through deepspeed_c.comm: one per step, one for the trace
        assert r["step_checks"] == r["trace"] > 0 and r["trace_checks"] == 1, r
