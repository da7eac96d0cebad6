"""Universal checkpoints of 16-bit runs (fp16 with its loss scaler, bf16), ZeRO 1-3 with sub_group_size, on
real gloo ranks: saved after 4 steps, converted by ds_to_universal, loaded with checkpoint.load_universal into
an engine built from other initial weights, trained 4 more steps. The reference is the run that saved and
went on without stopping: at the same world size the losses are the same to the bit (the conversion and load
lose nothing: fp32 masters, both Adam moments, step counts); at another world size they agree to 16-bit
reduction-order noise (rtol 1e-3; observed under 5e-4), and the first resumed loss, computed from the restored
weights before any update, is the same to 1e-6. DeepSpeed's own test_universal_checkpoint.py compares the
states for these dtypes; this checks that the run continues."""
from __future__ import annotations

import os
import types
from typing import Any

import numpy as np
import pytest
import torch

from tests.harness import run_distributed

GLOBAL, SAVE_AT, AFTER = 12, 4, 4


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 7), torch.nn.Linear(7, 3))


def _config(stage: int, dtype: str, sub_group_size: int, universal: bool) -> dict:
    cfg: dict = {"train_batch_size": GLOBAL, "steps_per_print": 10**9,
                 "optimizer": {"type": "Adam", "params": {"lr": 0.02}},
                 "zero_optimization": {"stage": stage, "sub_group_size": sub_group_size}}
    cfg[dtype] = {"enabled": True, "initial_scale_power": 8} if dtype == "fp16" else {"enabled": True}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def _train(engine: Any, rank: int, world: int, first: int, last: int) -> list[float]:
    per = GLOBAL // world
    dtype = next(engine.module.parameters()).dtype
    losses = []
    for s in range(first, last):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(GLOBAL, 6, generator=g), torch.randn(GLOBAL, 3, generator=g)
        out = engine(x[rank * per:(rank + 1) * per].to(dtype))
        loss = torch.nn.functional.mse_loss(out.float(), y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().clone()
        torch.distributed.all_reduce(t)
        losses.append(float(t) / world)
    return losses


def save_body(rank: int, world: int, path: str, stage: int, dtype: str, sgs: int) -> list[float]:
    import deepspeed_c

    engine, *_ = deepspeed_c.initialize(model=_model(1), config=_config(stage, dtype, sgs, False))
    _train(engine, rank, world, 0, SAVE_AT)
    engine.save_checkpoint(path, tag="t")
    return _train(engine, rank, world, SAVE_AT, SAVE_AT + AFTER)  # the uninterrupted run


def load_body(rank: int, world: int, path: str, stage: int, dtype: str, sgs: int) -> list[float]:
    import deepspeed_c

    engine, *_ = deepspeed_c.initialize(model=_model(2), config=_config(stage, dtype, sgs, True))
    engine.load_checkpoint(path, tag="t_universal")
    return _train(engine, rank, world, SAVE_AT, SAVE_AT + AFTER)


@pytest.mark.parametrize("stage,dtype,sgs,save_world,load_world", [
    (1, "fp16", 100, 2, 2),
    (1, "fp16", 100, 2, 1),
    (2, "bf16", 10**9, 2, 1),
    (3, "fp16", 100, 2, 3),
    (3, "bf16", 40, 2, 2),
    (3, "bf16", 40, 3, 2),
])
def test_16bit_universal_resume_continues_the_run(tmp_path: Any, stage: int, dtype: str, sgs: int, save_world: int,
                                                  load_world: int) -> None:
    from deepspeed_c.checkpoint.ds_to_universal import main as convert

    path = str(tmp_path)
    want = run_distributed(save_body, world_size=save_world, args=(path, stage, dtype, sgs))[0]
    convert(types.SimpleNamespace(input_folder=os.path.join(path, "t"), output_folder=os.path.join(path, "t_universal"),
                                  num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                  inject_missing_state=True))
    got = run_distributed(load_body, world_size=load_world, args=(path, stage, dtype, sgs))[0]
    if save_world == load_world:
        assert got == want
    else:
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
        np.testing.assert_allclose(got, want, rtol=1e-3)
    assert abs(want[-1] - want[0]) > 1e-3  # the continuation moved: a lost update would show
