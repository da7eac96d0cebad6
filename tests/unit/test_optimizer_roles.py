"""DeepSpeed's engine-built optimizer classes (FP16_Optimizer, FP16_UnfusedOptimizer, BF16_Optimizer) import
from DeepSpeed's module paths and answer isinstance for `engine.optimizer` where DeepSpeed 0.19.8's engine builds
that class; scripts then reach the basic optimizer through `.optimizer` and the scale through
`loss_scale_config`."""
from __future__ import annotations

import pytest
import torch

import deepspeed_c
from deepspeed_c.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed_c.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed_c.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed_c.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from tests.distributed.engine_models import MLP, loss_fn

pytestmark = pytest.mark.usefixtures("world_of_one")

ROLES = (FP16_Optimizer, FP16_UnfusedOptimizer, BF16_Optimizer)


def _engine(precision: dict, optimizer_factory=None, stage: int = 0, data_types: dict | None = None):
    model = MLP()
    config = {"train_micro_batch_size_per_gpu": 2, **precision, "zero_optimization": {"stage": stage}}
    if data_types:
        config["data_types"] = data_types
    if optimizer_factory is None:
        config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3}}
        engine, _, _, _ = deepspeed_c.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        basic = optimizer_factory(model.parameters())
        engine, _, _, _ = deepspeed_c.initialize(model=model, optimizer=basic, config=config)
    return engine


def _roles(opt) -> list[str]:
    return [cls.__name__ for cls in ROLES if isinstance(opt, cls)]


def _step(engine) -> None:
    w = engine.module.net[0].weight
    x = torch.randn(2, 12, dtype=w.dtype, device=w.device)
    engine.backward(loss_fn(engine(x), torch.randn(2, 3, dtype=x.dtype, device=w.device)))
    engine.step()


def test_fp16_stage0_unfused_reaches_basic_optimizer_and_live_scale():
    engine = _engine({"fp16": {"enabled": True, "initial_scale_power": 8}},
                     lambda ps: torch.optim.SGD(ps, lr=0.1))
    opt = engine.optimizer
    assert _roles(opt) == ["FP16_UnfusedOptimizer"]
    assert isinstance(opt.optimizer, torch.optim.SGD)  # the basic optimizer, as a script reaches it
    cfg = opt.loss_scale_config
    assert cfg.use_grad_scaling and cfg.dynamic_loss_scale
    assert cfg.cur_scale == 2.0 ** 8 == opt.cur_scale
    assert cfg.scale_window == 1000 and cfg.scale_factor == 2.0 and cfg.last_overflow_iter == -1
    before = cfg.cur_iter
    _step(engine)
    assert cfg.cur_iter == before + 1 == opt.cur_iter  # read live, not a copy


def test_fused_adam_is_fp16_optimizer_and_static_scale_fields():
    from deepspeed_c.ops.adam import FusedAdam

    engine = _engine({"fp16": {"enabled": True, "loss_scale": 128}}, lambda ps: FusedAdam(ps, lr=1e-3))
    assert _roles(engine.optimizer) == ["FP16_Optimizer"]
    cfg = engine.optimizer.loss_scale_config
    assert not cfg.dynamic_loss_scale and cfg.cur_scale == 128
    assert cfg.scale_window is None and cfg.last_overflow_iter is None and cfg.min_loss_scale is None


def test_bf16_roles_follow_gradient_accumulation_dtype():
    plain = _engine({"bf16": {"enabled": True}}, lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert _roles(plain.optimizer) == ["FP16_UnfusedOptimizer"]
    cfg = plain.optimizer.loss_scale_config
    assert not cfg.use_grad_scaling and cfg.cur_scale == 1.0
    # (stage 0 with fp32 accumulation is refused, as DeepSpeed's; a pipeline's is BF16_Optimizer: test_pipe_*)
    stage1 = _engine({"bf16": {"enabled": True}}, stage=1, data_types={"grad_accum_dtype": "fp32"})
    assert _roles(stage1.optimizer) == ["BF16_Optimizer"]
    assert isinstance(stage1.optimizer, DeepSpeedZeroOptimizer)
    stage2 = _engine({"bf16": {"enabled": True}}, stage=2, data_types={"grad_accum_dtype": "fp32"})
    assert _roles(stage2.optimizer) == []  # DeepSpeed's ZeRO optimizer there


def test_fp32_has_no_wrapper_role_and_direct_construction_is_refused():
    engine = _engine({}, lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert isinstance(engine.optimizer, torch.optim.SGD) and _roles(engine.optimizer) == []
    with pytest.raises(TypeError, match="built by deepspeed.initialize"):
        FP16_Optimizer(torch.optim.SGD(MLP().parameters(), lr=0.1))

