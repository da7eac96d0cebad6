"""checkpoint.writer on a PipelineEngine (2 gloo ranks, 2 stages, tied layers, ZeRO-1): save_checkpoint
stages each rank's layer, stage, ZeRO and RNG files and returns; train_batch goes on changing the weights
while the threads write them; checkpoint_commit gathers every rank's manifest entries and rank 0 commits.
A fresh engine without a writer that loads the checkpoint repeats the uninterrupted run's losses exactly
(the files hold the state at the save), nothing is visible before the commit, and the next save commits a
pending one."""
from __future__ import annotations

import os
from typing import Any

import torch

from tests.distributed import pipe_models as pm
from tests.harness import run_distributed


def _engine(writer: Any):
    import deepspeed_c as deepspeed
    from deepspeed_c.pipe import PipelineModule

    model = PipelineModule(pm.specs(), num_stages=2, loss_fn=pm.loss_fn, seed_layers=True)
    cfg = {"train_micro_batch_size_per_gpu": pm.MBS, "gradient_accumulation_steps": pm.GAS,
           "zero_optimization": {"stage": 1}, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "steps_per_print": 10**9}
    if writer is not None:
        cfg["checkpoint"] = {"writer": writer}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    return engine


def body(rank: int, world: int, root: str) -> dict:
    data = pm.batches(7, 1)
    engine = _engine({"type": "python"})
    engine.train_batch(iter(data[0]))
    engine.save_checkpoint(root, tag="a")
    res: dict[str, Any] = {"visible_before_commit": os.path.isdir(os.path.join(root, "a"))}
    straight = [float(engine.train_batch(iter(b))) for b in data[1:4]]
    res["committed"] = engine.checkpoint_commit()
    res["again"] = engine.checkpoint_commit()
    engine.save_checkpoint(root, tag="b")  # pending ...
    engine.save_checkpoint(root, tag="c")  # ... committed by the next save
    res["b_committed"] = os.path.isdir(os.path.join(root, "b"))
    engine.destroy()  # commits "c"
    res["c_committed"] = os.path.isdir(os.path.join(root, "c"))
    fresh = _engine(None)
    fresh.load_checkpoint(root, tag="a")
    res["resumed"] = [float(fresh.train_batch(iter(b))) for b in data[1:4]]
    res["straight"] = straight
    return res


def test_pipeline_background_save_resumes_exactly(tmp_path: Any) -> None:
    for res in run_distributed(body, 2, args=(str(tmp_path / "ckpt"),), timeout=240):
        assert res["visible_before_commit"] is False
        assert res["committed"] is True and res["again"] is False
        assert res["b_committed"] and res["c_committed"]
        assert len(set(res["straight"])) == 3  # training moves the loss: equality below is not trivial
        assert res["resumed"] == res["straight"]  # exact: the files hold the weights at the save
