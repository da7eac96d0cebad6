"""Bad input to deepspeed_c.initialize (one process): each error names the key or the cause.

What DeepSpeed 0.19.8 does is the rule for accept/refuse:
- `optimizer.params` values go unchecked into the optimizer there, and a string lr ("fast", even
  "1e-3") fails inside it (a comparison, or the first step's float conversion) without naming the
  key: refused here at initialize, naming `optimizer.params.<key>`.
- `zero_optimization.stage` is a pydantic field there, which coerces "2" to 2: accepted.
- `train_micro_batch_size_per_gpu` is read from the raw dict there and "4" fails its `> 0` check
  with a TypeError: refused here, naming the key and how to write it.
- A model with nothing trainable and an optimizer to build: torch's "optimizer got an empty
  parameter list" (or, with frozen tensors, a run that trains nothing) becomes a ValueError naming it.
"""
from __future__ import annotations

import pytest
import torch

import deepspeed_c
from deepspeed_c.runtime.config.utils import DeepSpeedConfigError

pytestmark = pytest.mark.usefixtures("world_of_one")


def _config(**kw) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    cfg.update(kw)
    return cfg


def _init(cfg: dict, model: torch.nn.Module | None = None, **kw):
    model = model if model is not None else torch.nn.Linear(4, 2)
    kw.setdefault("model_parameters", model.parameters())
    return deepspeed_c.initialize(model=model, config=cfg, **kw)


def _frozen() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model.requires_grad_(False)
    return model


@pytest.mark.parametrize("opt_type,zero", [
    ("Adam", {}),  # FusedAdam
    ("SGD", {}),  # a torch.optim class
    ("Adam", {"stage": 1, "offload_optimizer": {"device": "cpu"}}),  # DeepSpeedCPUAdam
    ("OneBitAdam", {}),
])
def test_non_numeric_lr_names_the_key(opt_type: str, zero: dict) -> None:
    cfg = _config(optimizer={"type": opt_type, "params": {"lr": "fast"}}, zero_optimization=zero)
    with pytest.raises(DeepSpeedConfigError, match=r"'fast' for config key 'optimizer\.params\.lr'.*expected a number"):
        _init(cfg)


def test_numeric_string_lr_is_refused_as_deepspeed_does_with_a_hint() -> None:
    cfg = _config(optimizer={"type": "Adam", "params": {"lr": "1e-3"}})
    with pytest.raises(DeepSpeedConfigError, match=r"optimizer\.params\.lr.*without quotes: 0\.001"):
        _init(cfg)


def test_non_numeric_betas_names_the_key() -> None:
    cfg = _config(optimizer={"type": "AdamW", "params": {"lr": 1e-3, "betas": ["0.9", 0.99]}})
    with pytest.raises(DeepSpeedConfigError, match=r"optimizer\.params\.betas.*a list of 2 numbers"):
        _init(cfg)


def test_numbers_still_pass() -> None:
    engine, optimizer, _, _ = _init(_config(optimizer={"type": "AdamW", "params": {"lr": 1, "betas": [0.9, 0.99],
                                                                                 "weight_decay": 0}}))
    assert optimizer.param_groups[0]["lr"] == 1


def test_string_zero_stage_is_coerced_as_deepspeeds_pydantic_does() -> None:
    engine, *_ = _init(_config(zero_optimization={"stage": "2"}))
    assert engine.zero_optimization_stage() == 2


def test_string_micro_batch_is_refused_naming_key_and_fix() -> None:
    with pytest.raises(DeepSpeedConfigError,
                       match=r"'train_micro_batch_size_per_gpu'.*write 4 without quotes"):
        _init(_config(train_micro_batch_size_per_gpu="4"))


@pytest.mark.parametrize("stage", [0, 2])
def test_no_trainable_parameters_filtered_to_nothing(stage: int) -> None:
    model = _frozen()
    with pytest.raises(ValueError, match=r"no trainable parameters: model_parameters is empty.*'Adam'"):
        _init(_config(zero_optimization={"stage": stage}), model,
              model_parameters=filter(lambda p: p.requires_grad, model.parameters()))


@pytest.mark.parametrize("stage", [0, 2])
def test_no_trainable_parameters_all_frozen(stage: int) -> None:
    with pytest.raises(ValueError, match=r"none of the 4 entries of model_parameters has requires_grad=True"):
        _init(_config(zero_optimization={"stage": stage}), _frozen())
    with pytest.raises(ValueError, match=r"all 4 parameters of Sequential have requires_grad=False"):
        _init(_config(zero_optimization={"stage": stage}), _frozen(), model_parameters=None)
    with pytest.raises(ValueError, match=r"no trainable parameters.*the optimizer callable"):
        _init(_config(optimizer=None), _frozen(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def test_frozen_model_without_optimizer_is_fine() -> None:
    engine, optimizer, _, _ = _init({"train_micro_batch_size_per_gpu": 2}, _frozen())
    assert optimizer is None
    assert engine(torch.randn(2, 4)).shape == (2, 2)


def test_iterators_are_not_used_up_by_the_check() -> None:
    model = _frozen()
    model[1].requires_grad_(True)
    trainable = filter(lambda p: p.requires_grad, model.parameters())
    engine, optimizer, _, _ = _init(_config(optimizer={"type": "SGD", "params": {"lr": 0.1}}), model,
                                    model_parameters=trainable)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 2
    groups = [{"params": (p for p in model[1].parameters()), "lr": 0.5}]
    engine, optimizer, _, _ = _init(_config(optimizer={"type": "SGD", "params": {"lr": 0.1}}), model,
                                    model_parameters=groups)
    assert [len(g["params"]) for g in optimizer.param_groups] == [2]
    before = model[1].weight.detach().clone()
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    assert not torch.equal(before, model[1].weight)
