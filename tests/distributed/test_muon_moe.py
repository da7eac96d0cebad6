"""Muon on a model with MoE layers (expert parallelism 1 and 2) on 2 gloo ranks: ZeRO 1 and 2 (one ZeRO member per
reduction set, each stepping a shallow copy of the optimizer with its own groups) end where stage 0 ends, whose
Muon step on whole tensors test_muon_zero.py checks against the float64 reference. 6 steps, fp32; every
parameter within 2e-5 norm-wise relative of stage 0's (they differ by reduction order only), and Muon moved the
expert matrices (so the comparison sees the experts' Muon step)."""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.distributed.moe_models import make_batches, make_full, make_sharded
from tests.harness import run_distributed

STEPS, PER_RANK = 6, 2


def body(rank: int, world: int, stage: int, ep: int) -> dict[str, Any]:
    import deepspeed_c

    model = make_sharded(make_full(0), rank, (ep, ep))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = {"train_micro_batch_size_per_gpu": PER_RANK, "gradient_clipping": 0.0,
           "optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 300}}
    engine, *_ = deepspeed_c.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dev = next(engine.module.parameters()).device
    for x, y in make_batches(STEPS, PER_RANK, world):
        engine.backward(engine(x[rank].to(dev), y[rank].to(dev)))
        engine.step()
    out = {n: p.detach().cpu().numpy() for n, p in engine.module.named_parameters()}
    moved = {n: float((p.detach().cpu() - start[n]).norm() / start[n].norm())
             for n, p in engine.module.named_parameters() if "experts" in n and p.ndim == 2}
    engine.destroy()
    return {"params": out, "moved": moved}


@functools.lru_cache(maxsize=None)
def _run(stage: int, ep: int) -> list[dict[str, Any]]:
    return run_distributed(body, 2, args=(stage, ep), timeout=240)


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("stage", [1, 2])
def test_moe_muon_zero_matches_stage0(stage: int, ep: int) -> None:
    for base, res in zip(_run(0, ep), _run(stage, ep)):
        assert base["moved"] and min(base["moved"].values()) > 1e-3
        for name, want in base["params"].items():
            got, ref = torch.from_numpy(res["params"][name]).double(), torch.from_numpy(want).double()
            assert ((got - ref).norm() / ref.norm()).item() < 2e-5, (stage, ep, name)
