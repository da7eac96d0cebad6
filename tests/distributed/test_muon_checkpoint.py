"""Muon's state (partitioned momentum, the auxiliary Adam's moments and step counts) through save_checkpoint /
load_checkpoint at ZeRO 0-3 on 2 gloo ranks: 5 steps, save, 5 more steps; a fresh engine that loads the
checkpoint and takes the same 5 steps ends bit-identical. At stage 2 the checkpoint is also loaded by one rank
that takes both ranks' micro-batches at once (the same mean gradient): DeepSpeed's on-disk layout re-cut for
another world size carries the momentum, so it ends equal within fp32 rounding (a lost or misplaced momentum
differs by > 1e-2 here: checked by a run that loads only the weights)."""
from __future__ import annotations

import functools
import pathlib
from typing import Any

import pytest
import torch

from tests.distributed.test_muon_zero import MICRO, PARAMS, TOL, _batches, _loss, _model
from tests.harness import run_distributed


def _cfg(stage: int, micro: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 0.0,
            "optimizer": {"type": "Muon", "params": dict(PARAMS)},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 200}}


def _train(engine: Any, batches: list, rank: int, micro: int) -> None:
    for x, y in batches:
        engine.backward(_loss(engine, x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro]))
        engine.step()


def _weights(engine: Any, stage: int) -> list[Any]:
    import deepspeed_c

    params = list(engine.module.parameters())
    if stage == 3:
        with deepspeed_c.zero.GatheredParameters(params):
            return [p.detach().clone().cpu().numpy() for p in params]
    return [p.detach().clone().cpu().numpy() for p in params]


def save_and_resume(rank: int, world: int, stage: int, path: str) -> dict[str, Any]:
    import deepspeed_c

    batches = _batches()
    engine, *_ = deepspeed_c.initialize(model=_model(), config=_cfg(stage, MICRO))
    _train(engine, batches[:5], rank, MICRO)
    engine.save_checkpoint(path, tag="five")
    _train(engine, batches[5:10], rank, MICRO)
    straight = _weights(engine, stage)
    engine.destroy()
    engine, *_ = deepspeed_c.initialize(model=_model(), config=_cfg(stage, MICRO))
    engine.load_checkpoint(path, tag="five")
    _train(engine, batches[5:10], rank, MICRO)
    resumed = _weights(engine, stage)
    engine.destroy()
    return {"straight": straight, "resumed": resumed}


def resume_on_one(rank: int, world: int, path: str, optimizer_states: bool) -> list[Any]:
    import deepspeed_c

    engine, *_ = deepspeed_c.initialize(model=_model(), config=_cfg(2, 2 * MICRO))
    engine.load_checkpoint(path, tag="five", load_optimizer_states=optimizer_states)
    _train(engine, _batches()[5:10], 0, 2 * MICRO)
    out = _weights(engine, 2)
    engine.destroy()
    return out


@functools.lru_cache(maxsize=None)
def _saved(stage: int, path: str) -> list[dict[str, Any]]:
    return run_distributed(save_and_resume, 2, args=(stage, path), timeout=240)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_is_bit_identical(stage: int, tmp_path: pathlib.Path) -> None:
    for res in _saved(stage, str(tmp_path)):
        for a, b in zip(res["straight"], res["resumed"]):
            assert (a == b).all()


def test_stage2_checkpoint_resumes_on_one_rank(tmp_path: pathlib.Path) -> None:
    straight = _saved(2, str(tmp_path))[0]["straight"]
    (one,) = run_distributed(resume_on_one, 1, args=(str(tmp_path), True), timeout=240)
    (cold,) = run_distributed(resume_on_one, 1, args=(str(tmp_path), False), timeout=240)
    errs = [float(torch.from_numpy(a - b).norm() / torch.from_numpy(b).norm()) for a, b in zip(one, straight)]
    cold_errs = [float(torch.from_numpy(a - b).norm() / torch.from_numpy(b).norm()) for a, b in zip(cold, straight)]
    assert max(errs) < TOL, errs
    assert max(cold_errs) > 1e-2, cold_errs  # the momentum matters: the comparison can see it
