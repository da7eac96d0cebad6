"""Muon in a PipelineEngine (2 stages, 2 gloo ranks): initialize flags the pipeline module's parameters as
DeepSpeed's (matrices Muon, biases Adam), and ZeRO 1 over each stage's (single-rank) data-parallel group takes
the partitioned path yet trains exactly as stage 0's whole-tensor step: the same losses within fp32 rounding."""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.harness import run_distributed


def body(rank: int, world: int, stage: int) -> dict[str, Any]:
    import deepspeed_c
    from deepspeed_c.pipe import PipelineModule
    from tests.distributed.pipe_models import batches, loss_fn, specs

    torch.manual_seed(0)
    model = PipelineModule(layers=specs(False), num_stages=2, loss_fn=loss_fn)
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4, "gradient_clipping": 0.0,
           "optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.01}},
           "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed_c.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    flags = {n: bool(p.use_muon) for n, p in model.named_parameters()}
    partitioned = any(p.ndim < 2 for g in engine.basic_optimizer.param_groups if g["use_muon"] for p in g["params"])
    losses = [float(engine.train_batch(iter(step))) for step in batches(6, 1)]
    return {"flags": flags, "losses": losses, "partitioned": partitioned}


@functools.lru_cache(maxsize=None)
def _run(stage: int) -> list[dict[str, Any]]:
    return run_distributed(body, 2, args=(stage,), timeout=240)


@pytest.mark.parametrize("stage", [1])
def test_pipeline_muon_zero1_matches_stage0(stage: int) -> None:
    for base, res in zip(_run(0), _run(stage)):
        assert all(v == n.endswith("weight") for n, v in base["flags"].items()) and base["flags"]
        assert res["partitioned"] and not base["partitioned"]
        assert base["losses"][-1] < base["losses"][0]
        assert max(abs(a - b) / abs(b) for a, b in zip(res["losses"], base["losses"])) < 1e-5
