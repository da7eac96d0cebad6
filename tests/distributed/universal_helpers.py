"""Resuming the DeepSpeed-written fixture run (tests/fixtures/deepspeed_written) from a universal checkpoint,
shared by the universal-checkpoint and the interchange tests."""
from __future__ import annotations

import os
import sys

import torch

DEEPSPEED_WRITTEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                                 "deepspeed_written")


def resume_deepspeed_written(rank: int, world: int, folder: str, stages: list, bf16: bool = False) -> dict:
    """Per ZeRO stage: the fixture model loaded from the universal folder with load_universal, trained the
    fixture's after-resume steps on `world` ranks (the fixture's two ranks' batches split over them); the
    mean losses."""
    import deepspeed_c

    sys.path.insert(0, DEEPSPEED_WRITTEN)
    import common

    out = {}
    for stage in stages:
        model = common.build_model(False)
        cfg = common.config(stage, bf16, world)
        cfg["train_micro_batch_size_per_gpu"] = common.MICRO_BATCH * 2 // world
        cfg["train_batch_size"] = common.MICRO_BATCH * 2
        cfg["checkpoint"] = {"load_universal": True}
        engine = deepspeed_c.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)[0]
        engine.load_checkpoint(os.path.dirname(folder), tag=os.path.basename(folder))
        losses = []
        for i in range(common.STEPS_AFTER_RESUME):
            xs, ys = zip(*[common.batch(common.STEPS_BEFORE_SAVE + i, r, 2) for r in range(2)])
            x, y = torch.cat(xs), torch.cat(ys)
            n = x.shape[0] // world
            loss = engine(x[rank * n:(rank + 1) * n].to(torch.bfloat16 if bf16 else torch.float32),
                          y[rank * n:(rank + 1) * n])
            engine.backward(loss)
            engine.step()
            mean = loss.detach().float().clone()
            if world > 1:
                torch.distributed.all_reduce(mean)
            losses.append(float(mean) / world)
        out[stage] = losses
        engine.destroy()
    return out
