"""The legacy seqlen curriculum with progressive layer drop trains a small GPT on 2 gloo ranks to DeepSpeed
0.19.6's losses (fp32, 1e-5): tests/fixtures/data_efficiency/legacy_run.py is the run, legacy_losses.npz holds
the losses the real DeepSpeed 0.19.6 made (make_legacy_losses.py)."""
from __future__ import annotations

import os

import numpy as np

from tests.fixtures.data_efficiency import legacy_run as L
from tests.harness import run_distributed

PINNED = os.path.join(os.path.dirname(L.__file__), "legacy_losses.npz")


def body(rank: int, world: int) -> list[float]:
    import deepspeed_c

    model, opt = L.build()
    engine, *_ = deepspeed_c.initialize(model=model, optimizer=opt, config=L.config())
    losses = L.train(engine, rank, world)
    engine.destroy()
    return losses


def test_losses_equal_deepspeed_0196_on_2_ranks():
    with np.load(PINNED) as data:
        ref = data["losses"]
    results = run_distributed(body, world_size=2, timeout=240)
    assert results[0] == results[1]
    np.testing.assert_allclose(np.array(results[0]), ref, rtol=0, atol=1e-5)
    assert ref[-1] < ref[0]  # it trains
