"""DeepSpeedDataSampler yields DeepSpeed 0.19.8's global sample order for the same index files, seed and
global batch (pinned from DeepSpeed's own sampler by tests/fixtures/data_efficiency/make_sampler_fixtures.py,
which also wrote the index files with DeepSpeed's builder): value- and percentile-based difficulties,
fixed_linear / fixed_root / fixed_discrete schedules, two metrics (intersected clusters), single_cluster. On
1, 2 and 4 gloo ranks the ranks' slices put together are that order; a sampler restored from a state_dict
taken mid-epoch continues with the identical order."""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.fixtures.data_efficiency import sampler_cases as C
from tests.harness import run_distributed

ORDERS = os.path.join(C.HERE, "sampler_orders.npz")


def _sampler(case: str, clusters: str, rank: int, world: int, gas: int):
    import torch.distributed as dist

    from deepspeed_c.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler

    group = dist.group.WORLD if dist.is_initialized() else None
    micro = C.GLOBAL_BATCH // world // gas
    return DeepSpeedDataSampler(C.data_efficiency_config(case, clusters), C.SAMPLES, micro, rank, world, group, gas,
                                rank)


def body(rank: int, world: int, clusters: str, gas: int, resume_at: int) -> dict:
    out = {}
    for case in C.CASES:
        path = os.path.join(clusters, case)
        sampler = _sampler(case, path, rank, world, gas)
        it = iter(sampler)
        micro_batches = C.GLOBAL_BATCH * C.GLOBAL_BATCHES // (C.GLOBAL_BATCH // gas)
        mine = [next(it) for _ in range(micro_batches)]
        # resume: a second sampler restored from the first's state after resume_at micro-batches
        first = _sampler(case, os.path.join(clusters, case + "_resume"), rank, world, gas)
        it1 = iter(first)
        head = [next(it1) for _ in range(resume_at)]
        state = first.state_dict()
        del it1
        second = _sampler(case, os.path.join(clusters, case + "_resume"), rank, world, gas)
        second.load_state_dict(state)
        it2 = iter(second)
        tail = [next(it2) for _ in range(micro_batches - resume_at)]
        out[case] = {"mine": mine, "resumed": head + tail}
    return out


def _global(results: list, case: str, key: str) -> list:
    order = []
    for step in range(len(results[0][case][key])):
        for res in results:
            order.extend(int(s) for s in res[case][key][step])
    return order


@pytest.mark.parametrize("world, gas", [(1, 1), (2, 2), (4, 1)])
def test_global_order_equals_deepspeed_and_resumes_identically(tmp_path, world, gas):
    with np.load(ORDERS) as data:
        pinned = {k: data[k].tolist() for k in data.files}
    assert set(pinned) == set(C.CASES)
    # resume inside a global batch when gas > 1 (the leftover batch is part of the state) and after
    # several clusters were opened and reshuffled
    resume_at = 37
    results = run_distributed(body, world_size=world, args=(str(tmp_path), gas, resume_at), timeout=300)
    for case in C.CASES:
        assert _global(results, case, "mine") == pinned[case], case
        assert _global(results, case, "resumed") == pinned[case], case
