"""ZeRO stage 1/2 in one process: config acceptance, DeepSpeed's optimizer checks, the state_dict round
trip the checkpoint layer relies on, and the ZeRO-2 memory estimators (DeepSpeed's published t5-3b
figures on 1 node x 8 GPUs: 127.45 GB per CPU, 5.31 GB per GPU with optimizer offload, 15.93 without)."""
from __future__ import annotations

import copy
import re

import pytest
import torch

import deepspeed_c
from deepspeed_c.runtime.config import DeepSpeedConfig
from deepspeed_c.runtime.zero.stage_1_and_2 import (DeepSpeedZeroOptimizer, estimate_zero2_model_states_mem_needs,
                                                    estimate_zero2_model_states_mem_needs_all_cold,
                                                    estimate_zero2_model_states_mem_needs_all_live)
from tests.distributed.engine_models import loss_fn, make_batches, make_model

pytestmark = pytest.mark.usefixtures("world_of_one")  # in-process initialize: no process group leaks


def cfg(stage: int = 2, **extra):
    out = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 200}}
    out.update(extra)
    return out


def train(engine, steps: int, seed: int = 3) -> list[float]:
    losses = []
    for x, y in make_batches("mlp", steps, 2, seed=seed):
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def test_config_accepts_stages_1_2_3_and_cpu_offload():
    for stage in (1, 2, 3):
        c = DeepSpeedConfig(cfg(stage))
        assert c.zero_optimization_stage == stage
        c = DeepSpeedConfig(cfg(stage, zero_optimization={"stage": stage, "offload_optimizer": {"device": "cpu"}}))
        assert c.zero_config.offload_optimizer.device == "cpu"
    c = DeepSpeedConfig(cfg(2, zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme",
                                                                                    "nvme_path": "/x"}}))
    assert c.zero_config.offload_optimizer.device == "nvme"  # ZeRO-Infinity (the path is checked at initialize)
    with pytest.raises(ValueError, match="offload_optimizer.nvme_path"):
        DeepSpeedConfig(cfg(2, zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme"}}))
    # DeepSpeed reads offload_param at stage 3 only: below it the key is accepted with a warning that it has
    # no effect (and no nvme_path is asked for)
    for device in ("cpu", "nvme"):
        with pytest.warns(UserWarning, match=r"zero_optimization\.offload_param.*no effect at ZeRO stage 2"):
            c = DeepSpeedConfig(cfg(2, zero_optimization={"stage": 2, "offload_param": {"device": device}}))
        assert c.zero_optimization_stage == 2 and c.zero_config.offload_param.device == device
    with pytest.warns(UserWarning, match=r"zero_optimization\.offload_optimizer.*no effect at ZeRO stage 0"):
        DeepSpeedConfig(cfg(0, zero_optimization={"stage": 0, "offload_optimizer": {"device": "nvme"}}))


@pytest.mark.parametrize("stage", [1, 2])
def test_engine_wraps_zero_optimizer(stage: int):
    engine, optimizer, _, _ = deepspeed_c.initialize(model=make_model("mlp", 0), config=cfg(stage))
    assert isinstance(optimizer, DeepSpeedZeroOptimizer) and optimizer.stage == stage
    assert engine.optimizer is optimizer
    # the wrapped optimizer steps one flat fp32 partition per group
    assert [len(g["params"]) for g in optimizer.param_groups] == [1]
    plan = optimizer.partition_plans[0]
    assert sum(plan.numels) == sum(p.numel() for p in engine.module.parameters())
    assert optimizer.fp32_partitions[0].numel() == plan.runtime_partition_size
    assert optimizer.fp32_partitions[0].dtype == torch.float32
    before = [p.detach().clone() for p in engine.module.parameters()]
    train(engine, 2)
    assert all(not torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
    engine.destroy()


def test_untested_optimizer_needs_the_flag():
    model = make_model("mlp", 0)
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    with pytest.raises(AssertionError, match="zero_allow_untested_optimizer"):
        deepspeed_c.initialize(model=model, config=cfg(2, optimizer=sgd))
    engine, *_ = deepspeed_c.initialize(model=make_model("mlp", 0),
                                        config=cfg(2, optimizer=sgd, zero_allow_untested_optimizer=True))
    engine.destroy()


def test_offload_with_client_optimizer_needs_ds_cpu_optimizer():
    off = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    model = make_model("mlp", 0)
    config = cfg(2, zero_optimization=off)
    del config["optimizer"]
    from deepspeed_c.runtime.zero.utils import ZeRORuntimeException

    # DeepSpeed's exception class, importable from its path, and still a RuntimeError
    with pytest.raises(ZeRORuntimeException, match="zero_force_ds_cpu_optimizer") as caught:
        deepspeed_c.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    assert isinstance(caught.value, RuntimeError)
    model = make_model("mlp", 0)
    engine, *_ = deepspeed_c.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                        config=dict(config, zero_force_ds_cpu_optimizer=False))
    engine.destroy()


def test_no_sync_refused_for_stage2():
    engine, *_ = deepspeed_c.initialize(model=make_model("mlp", 0), config=cfg(2))
    with pytest.raises(AssertionError, match="incompatible"):
        with engine.no_sync():
            pass
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2])
def test_state_dict_round_trip(stage: int):
    engine, opt, _, _ = deepspeed_c.initialize(model=make_model("mlp", 0), config=cfg(stage))
    train(engine, 3)
    state = copy.deepcopy(opt.state_dict())
    assert state["zero_stage"] == stage and state["partition_count"] == 1
    assert len(state["single_partition_of_fp32_groups"]) == len(opt.partition_plans) == 1
    assert set(opt.local_optimizer_state(0)) >= {"exp_avg", "exp_avg_sq"}
    expected = train(engine, 3, seed=4)
    engine.destroy()

    engine2, opt2, _, _ = deepspeed_c.initialize(model=make_model("mlp", 1), config=cfg(stage))
    opt2.load_state_dict(state)
    assert train(engine2, 3, seed=4) == expected
    with pytest.raises(ValueError, match="different parameter layout"):
        opt2.load_state_dict(dict(state, group_numels=[[1, 2]]))
    engine2.destroy()


def test_frozen_params_are_not_partitioned():
    model = make_model("mlp", 0)
    model.net[0].weight.requires_grad_(False)
    frozen = model.net[0].weight.detach().clone()
    engine, opt, _, _ = deepspeed_c.initialize(model=model, config=cfg(2))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(opt.partition_plans[0].numels) == trainable
    train(engine, 2)
    assert torch.equal(model.net[0].weight.detach(), frozen)
    engine.destroy()


def _gb(text: str) -> list[tuple[float, float, str]]:
    return [(float(a), float(b), c) for a, b, c in re.findall(r"([\d.]+)GB \|\s+([\d.]+)GB \| offload_optimizer=(\w+)",
                                                                text)]


def test_estimators_match_deepspeed_published_figures(capsys):
    estimate_zero2_model_states_mem_needs_all_cold(2851e6, num_gpus_per_node=8, num_nodes=1)
    rows = _gb(capsys.readouterr().out)
    assert rows == [(127.45, 5.31, "cpu"), (127.45, 15.93, "none")]


def test_estimator_all_live_counts_the_model(capsys):
    model = make_model("mlp", 0)
    n = sum(p.numel() for p in model.parameters())
    estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    out = capsys.readouterr().out
    assert "1 node, 2 GPUs per node" in out
    cpu, gpu = estimate_zero2_model_states_mem_needs(n, 2, 1, cpu_offload=False)
    assert gpu == 4 * n + (16 * n) // 2 and cpu == int(n * 4 * 2 * 1.5)
    cpu, gpu = estimate_zero2_model_states_mem_needs(n, 2, 1, cpu_offload=True)
    assert gpu == 2 * n and cpu == int(n * 16 * 1.5)
