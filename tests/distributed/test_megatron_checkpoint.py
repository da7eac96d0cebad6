"""save_checkpoint / load_checkpoint with a client's tensor parallelism (issue 54), 4 gloo ranks, TP 2 x DP 2.

Files are named as DeepSpeed names them under an mpu: mp_rank_{tp:02d}_model_states.pt (each
model-parallel rank's shards, written by its data-parallel rank 0) and, under ZeRO,
zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt (ZeRO-3: also the per-rank model-states files).
Resume equality: 5 steps, save, 5 more; a fresh engine from other initial weights loads the save and
runs the same 5 steps: its losses and final weights must equal the uninterrupted run's (to float
rounding; the unsplit single-process run is the independent reference of test_megatron_mpu)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.distributed import megatron_models as mm
from tests.distributed.test_megatron_mpu import MICRO, config, train
from tests.harness import run_distributed


def body(rank: int, world: int, stages: tuple, root: str) -> dict:
    import deepspeed_c

    mpu = mm.MegatronMPU(tp=2)
    data = mm.batches(10, MICRO * mpu.dp, seed=5)
    out = {}
    for stage in stages:
        ckpt = os.path.join(root, f"stage{stage}")
        engine, *_ = deepspeed_c.initialize(model=mm.sharded_model(mpu, seed=0), config=config(stage), mpu=mpu)
        train(engine, mpu, data, range(5))
        engine.save_checkpoint(ckpt, tag="t5")
        straight, _ = train(engine, mpu, data, range(5, 10))
        want = mm.full_state(engine.module, mpu.context())
        fresh, *_ = deepspeed_c.initialize(model=mm.sharded_model(mpu, seed=7), config=config(stage), mpu=mpu)
        path, client = fresh.load_checkpoint(ckpt, tag="t5")
        resumed, _ = train(fresh, mpu, data, range(5, 10))
        errs = mm.rel_errors(mm.full_state(fresh.module, mpu.context()), want)
        out[stage] = {"files": sorted(os.listdir(os.path.join(ckpt, "t5"))), "path": os.path.basename(path),
                      "loss_err": float(np.max(np.abs(np.array(straight) - resumed))), "weight_rel": max(errs.values()),
                      "steps": fresh.global_steps}
    return out


def _expected_files(stage: int) -> set:
    if stage == 3:
        return {f"zero_pp_rank_{d}_mp_rank_{t:02d}_{kind}_states.pt" for d in (0, 1) for t in (0, 1)
                for kind in ("model", "optim")}
    model = {f"mp_rank_{t:02d}_model_states.pt" for t in (0, 1)}
    if stage == 0:
        return model
    return model | {f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt" for d in (0, 1) for t in (0, 1)}


def _check(results: list, stages: tuple) -> None:
    for rank, r in enumerate(results):
        for s in stages:
            got = r[s]
            assert _expected_files(s) <= set(got["files"]), (s, got["files"])
            assert not any("mp_rank_02" in f for f in got["files"]), got["files"]
            assert got["steps"] == 10, got
            assert got["loss_err"] < 1e-6 and got["weight_rel"] < 1e-6, (s, got)
            if s != 3:
                assert got["path"] == f"mp_rank_{rank % 2:02d}_model_states.pt", got


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> list:
    """All four stages in one 4-rank launch (each stage saves under its own folder): the same runs as
    one launch per test, one 4-rank start on 2 cores instead of two."""
    return run_distributed(body, 4, args=((0, 1, 2, 3), str(tmp_path_factory.mktemp("mp_ckpt"))), timeout=600)


def test_tp2_dp2_resume_zero_0_1(resumed):
    _check(resumed, (0, 1))


def test_tp2_dp2_resume_zero_2_3(resumed):
    _check(resumed, (2, 3))
