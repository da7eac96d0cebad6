"""The engine's setup glue (runtime/engine/model_setup.py, optimizer_setup.py) on the narrow inputs it takes, with
no engine built: the basic optimizer's three client forms and its param-group checks, the scheduler's target,
and the model's placement on one rank. The engine's use of them is covered end to end by tests/unit/test_engine.py
and the distributed parity tests (test_zero_parity, test_moe_parity, test_sparse_gradients, test_autoep)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepspeed_c.runtime.config.utils import DeepSpeedConfigError
from deepspeed_c.runtime.engine.model_setup import place_model
from deepspeed_c.runtime.engine.optimizer_setup import build_basic_optimizer, build_lr_scheduler
from deepspeed_c.runtime.parallel_dims import ParallelDims
from deepspeed_c.runtime.precision import Precision


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _basic(client, params, config=None):
    return build_basic_optimizer(client, config or SimpleNamespace(optimizer_name=None, optimizer_params=None),
                                 params, torch.device("cpu"), cpu_optimizer=False, deepspeed=None)


def test_client_optimizer_forms():
    model = _model()
    params = list(model.parameters())
    sgd = torch.optim.SGD(params, lr=0.1)
    assert _basic(sgd, params) is sgd
    made = _basic(lambda ps: torch.optim.Adam(ps, lr=0.01), params)
    assert isinstance(made, torch.optim.Adam) and made.param_groups[0]["params"] == params
    with pytest.raises(TypeError, match="Client Optimizer is of unexpected type <class 'str'>"):
        _basic("adam", params)


def test_configured_optimizer_is_built_from_the_config():
    params = list(_model().parameters())
    opt = _basic(None, params, SimpleNamespace(optimizer_name="SGD", optimizer_params={"lr": 0.25}))
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["lr"] == 0.25
    assert [p for g in opt.param_groups for p in g["params"]] == params


def test_empty_param_groups_are_dropped_and_duplicates_refused():
    a, b = _model()[0].parameters()
    opt = torch.optim.SGD([{"params": [a]}, {"params": []}, {"params": [b], "lr": 0.5}], lr=0.1)
    basic = _basic(opt, [a, b])
    assert [g["params"] for g in basic.param_groups] == [[a], [b]]
    dup = torch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.1)
    dup.param_groups[1]["params"].append(a)  # torch refuses this in its constructor; a client can still do it
    with pytest.raises(ValueError, match=r"more than one param group.*param_groups\[0\] and param_groups\[1\]"):
        _basic(dup, [a, b])
    with pytest.raises(AssertionError):  # DeepSpeed's exception type, for scripts that catch it
        _basic(dup, [a, b])
    with pytest.raises(AssertionError, match="unexpected type"):
        _basic(42, [a, b])


def test_scheduler_targets():
    params = list(_model().parameters())
    wrapped, basic = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(params, lr=0.1)
    none = SimpleNamespace(scheduler_name=None, scheduler_params=None)
    assert build_lr_scheduler(None, none, wrapped, basic) is None
    client = torch.optim.lr_scheduler.StepLR(basic, step_size=1)
    assert build_lr_scheduler(client, none, wrapped, basic) is client
    seen = []
    made = build_lr_scheduler(lambda opt: seen.append(opt) or "made", none, wrapped, basic)
    assert made == "made" and seen == [basic]  # a client callable is handed the basic optimizer
    # deepspeed_c's own schedulers drive the (precision-wrapped) optimizer, torch's the basic one
    warmup = build_lr_scheduler(None, SimpleNamespace(scheduler_name="WarmupLR", scheduler_params={}), wrapped, basic)
    assert warmup.optimizer is wrapped
    step = build_lr_scheduler(None, SimpleNamespace(scheduler_name="StepLR", scheduler_params={"step_size": 2}),
                              wrapped, basic)
    assert step.optimizer is basic and step.step_size == 2
    with pytest.raises(DeepSpeedConfigError, match=r"Invalid 'scheduler.params' for StepLR"):
        build_lr_scheduler(None, SimpleNamespace(scheduler_name="StepLR", scheduler_params={"bogus": 1}),
                           wrapped, basic)


def test_place_model_on_one_rank():
    from deepspeed_c.runtime.config import DeepSpeedConfig

    config = DeepSpeedConfig({"train_batch_size": 1, "bf16": {"enabled": True}})
    model = _model()
    reference = [p.detach().clone() for p in model.parameters()]
    placed = place_model(model, Precision(config), torch.device("cpu"), move_to_device=True,
                         parallel_dims=ParallelDims.from_mpu(None, 1, 1), mpu=None, config=config)
    assert placed.first_dataloader_check is None  # no AutoTP sharding
    assert not placed.moe.has_moe_layers and placed.moe.num_experts == []
    for p, ref in zip(model.parameters(), reference):
        assert p.dtype == torch.bfloat16 and p.device.type == "cpu"
        torch.testing.assert_close(p.float(), ref.to(torch.bfloat16).float(), rtol=0, atol=0)
