"""A checkpoint saved before the first optimizer step (DeepSpeed's "save right after initialize", as its
TestZeROPPLoadCheckpoint does) loads with load_optimizer_states=True: the wrapped optimizer has no state yet,
and ZeRO-3's reader used to hand torch an empty per-group entry that FusedAdam's load then rejected
(KeyError 'step'). Real gloo ranks; the reference is an engine built from the saved weights that never
saved or loaded: after the load, training continues with its losses and weights (fp32, relative 1e-6)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.harness import run_distributed

GLOBAL, STEPS = 4, 3


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 5), torch.nn.Linear(5, 3))


def _engine(seed: int, world: int, stage: int, client_adam: bool, hpz: int) -> Any:
    import deepspeed_c

    model = _model(seed)
    cfg: dict = {"train_batch_size": GLOBAL, "steps_per_print": 10**9,
                 "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if hpz:
        cfg["zero_optimization"]["zero_hpz_partition_size"] = hpz
    if client_adam:  # the optimizer a user brings: torch's own Adam state format
        engine, *_ = deepspeed_c.initialize(model=model, config=cfg,
                                            optimizer=torch.optim.Adam(model.parameters(), lr=0.05))
    else:
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 0.05}}
        engine, *_ = deepspeed_c.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _train(engine: Any, rank: int, world: int) -> list[float]:
    losses = []
    per = GLOBAL // world
    for s in range(STEPS):
        g = torch.Generator().manual_seed(50 + s)
        x, y = torch.randn(GLOBAL, 6, generator=g), torch.randn(GLOBAL, 3, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        torch.distributed.all_reduce(t)
        losses.append(float(t) / world)
    return losses


def _weights(engine: Any) -> dict:
    import deepspeed_c

    params = list(engine.module.parameters())
    with deepspeed_c.zero.GatheredParameters(params):
        return {k: v.detach().double().numpy().copy() for k, v in engine.module.state_dict().items()}


def save_body(rank: int, world: int, path: str, stage: int, client_adam: bool, hpz: int) -> None:
    _engine(1, world, stage, client_adam, hpz).save_checkpoint(path, tag="init")


def load_body(rank: int, world: int, path: str, stage: int, client_adam: bool, hpz: int) -> tuple:
    engine = _engine(2, world, stage, client_adam, hpz)  # other initial weights: the load must replace them
    engine.load_checkpoint(path, tag="init", load_optimizer_states=True)
    if stage == 3:  # the loaded shards, read as DeepSpeed's TestZeROPPLoadCheckpoint reads them
        from deepspeed_c.runtime.zero.partition_parameters import ZeroParamStatus

        params = [p for p in engine.module.parameters() if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        assert params, "stage 3 with persistence threshold 0 leaves every parameter partitioned"
        params[0].all_gather_coalesced(params).wait()
        saved = dict(_model(1).named_parameters())
        for name, p in engine.module.named_parameters():
            assert torch.equal(p.data.cpu(), saved[name].data), name
        params[0].partition(params)
    return _train(engine, rank, world), _weights(engine)


def reference_body(rank: int, world: int, stage: int, client_adam: bool, hpz: int) -> tuple:
    engine = _engine(1, world, stage, client_adam, hpz)
    return _train(engine, rank, world), _weights(engine)


@pytest.mark.parametrize("stage,client_adam,save_world,load_world,hpz", [
    (3, False, 2, 2, 0),
    (3, False, 2, 1, 0),
    (3, True, 2, 2, 0),
    (3, False, 4, 4, 2),  # ZeRO++ hpZ, as DeepSpeed's own test saves it
    (1, False, 2, 1, 0),
    (2, True, 2, 2, 0),
])
def test_checkpoint_saved_before_first_step_loads_and_trains(tmp_path: Any, stage: int, client_adam: bool,
                                                             save_world: int, load_world: int, hpz: int) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(save_body, world_size=save_world, args=(path, stage, client_adam, hpz))
    got = run_distributed(load_body, world_size=load_world, args=(path, stage, client_adam, hpz))
    want = run_distributed(reference_body, world_size=load_world, args=(stage, client_adam, hpz))
    losses, weights = got[0]
    ref_losses, ref_weights = want[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert losses[0] != losses[-1]  # it trained
    assert weights.keys() == ref_weights.keys()
    for k in weights:
        np.testing.assert_allclose(weights[k], ref_weights[k], rtol=1e-6, atol=1e-7, err_msg=k)
