"""`bf16.bf16_optimizer_states` (issue 49 item 2), DeepSpeed 0.19.8's behaviour under ZeRO-Offload:
- the engine-built DeepSpeedCPUAdam keeps its Adam moments in bf16 (beside the bf16 masters of
  `bf16_master_weights_and_grads`), overriding a configured `fp32_optimizer_states: true` with a warning;
- a client DeepSpeedCPUAdam must have been built with fp32_optimizer_states=False, else initialize
  raises AssertionError naming it (DeepSpeed's TestBF16OptimizerStatesOffloadValidation);
- the step with bf16 moments agrees with a float64 Adam whose moments are rounded to bf16.
The C kernels' bf16-moment paths (every SIMD path, float64 reference) are tested in
tests/unit/test_cpu_optimizers.py."""
from __future__ import annotations

import logging

import pytest
import torch

import deepspeed_c
from deepspeed_c.ops.adam import DeepSpeedCPUAdam
from deepspeed_c.utils.logging import logger
from tests.distributed.engine_models import MLP, loss_fn
from tests.unit.cpu_optim_reference import assert_within_one_ulp

pytestmark = pytest.mark.usefixtures("world_of_one")

LR, B1, B2, EPS = 1e-3, 0.9, 0.999, 1e-8


def _config(stage: int, states: bool = True, **opt_params) -> dict:
    bf16 = {"enabled": True, "bf16_master_weights_and_grads": True}
    if states:
        bf16["bf16_optimizer_states"] = True
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "steps_per_print": 10**9,
            "optimizer": {"type": "Adam", "params": {"lr": LR, **opt_params}}, "bf16": bf16,
            "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return MLP()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 12, generator=g).bfloat16(), torch.randn(2, 3, generator=g).bfloat16()


def _moments(engine) -> list[torch.Tensor]:
    out = [t for st in engine.optimizer.optimizer.state.values() for k, t in st.items()
           if k in ("exp_avg", "exp_avg_sq")]
    assert out, "no Adam moments after a step"
    return out


def _one_step(engine) -> None:
    x, y = _batch()
    engine.backward(loss_fn(engine(x), y))
    engine.step()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_client_cpu_adam_with_fp32_states_is_refused(stage):
    model = _model()
    cfg = _config(stage)
    del cfg["optimizer"]
    with pytest.raises(AssertionError, match="fp32_optimizer_states=False"):
        deepspeed_c.initialize(model=model, config=cfg, optimizer=DeepSpeedCPUAdam(model.parameters()))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_client_cpu_adam_with_bf16_states_trains(stage):
    model = _model()
    cfg = _config(stage)
    del cfg["optimizer"]
    opt = DeepSpeedCPUAdam(model.parameters(), lr=LR, fp32_optimizer_states=False)
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg, optimizer=opt)
    _one_step(engine)
    assert {(m.dtype, m.device.type) for m in _moments(engine)} == {(torch.bfloat16, "cpu")}
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_config_cpu_adam_keeps_bf16_moments_and_steps_like_reference(stage):
    ref = _model().bfloat16()
    x, y = _batch()
    loss_fn(ref(x), y).backward()
    engine, *_ = deepspeed_c.initialize(model=_model(), config=_config(stage))
    _one_step(engine)
    moments = _moments(engine)
    assert {(m.dtype, m.device.type) for m in moments} == {(torch.bfloat16, "cpu")}
    assert sum(m.numel() for m in moments) >= 2 * sum(p.numel() for p in ref.parameters())  # + alignment
    with deepspeed_c.zero.GatheredParameters(list(engine.module.parameters())):
        got = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for n, p in ref.named_parameters():
        g = p.grad.double()
        m = ((1 - B1) * g).bfloat16().double()  # the moments are stored in bf16
        v = ((1 - B2) * g * g).bfloat16().double()
        want = p.detach().double() - LR * (m / (1 - B1)) / ((v / (1 - B2)).sqrt() + EPS)
        # one bf16 ulp of the result, plus the update's own bf16 precision: whether the update reads the
        # moments before or after their rounding to bf16 moves it by up to 2^-8 of its size
        assert_within_one_ulp(got[n].reshape(-1), want.reshape(-1).bfloat16(), n,
                              scale=torch.full_like(want.reshape(-1), LR * 2**-8 / (4 * 2**-24)))
    engine.destroy()


def test_configured_fp32_states_are_overridden_with_a_warning():
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = _Keep(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        engine, *_ = deepspeed_c.initialize(model=_model(), config=_config(2, fp32_optimizer_states=True))
    finally:
        logger.removeHandler(handler)
    assert any("bf16_optimizer_states" in r and "fp32_optimizer_states" in r for r in records), records
    _one_step(engine)
    assert {m.dtype for m in _moments(engine)} == {torch.bfloat16}
    engine.destroy()


def test_without_the_key_moments_stay_fp32():
    engine, *_ = deepspeed_c.initialize(model=_model(), config=_config(2, states=False))
    _one_step(engine)
    assert {m.dtype for m in _moments(engine)} == {torch.float32}
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("offload", [True, False], ids=["offload", "device"])
def test_master_weights_gradients_match_plain_pytorch(stage, offload):
    """DeepSpeed's TestBF16MasterWeightsGradients: with bf16 masters and bf16 optimizer states, the
    gradients the engine holds after backward are the plain bf16 model's, and a step runs."""
    from deepspeed_c.utils import safe_get_full_grad

    ref = _model().bfloat16()
    x, y = _batch()
    loss_fn(ref(x), y).backward()
    cfg = _config(stage)
    if not offload:
        del cfg["zero_optimization"]["offload_optimizer"]
    engine, *_ = deepspeed_c.initialize(model=_model(), config=cfg)
    engine.backward(loss_fn(engine(x), y))
    for (n, p), (_, r) in zip(engine.module.named_parameters(), ref.named_parameters()):
        g = safe_get_full_grad(p)
        assert g is not None, n
        torch.testing.assert_close(g.float(), r.grad.float(), rtol=1e-2, atol=1e-3, msg=n)
    engine.step()
    engine.destroy()


def test_device_fused_adam_warns_that_its_moments_stay_fp32():
    """Without offload the engine's FusedAdam keeps fp32 moments (its kernels have no bf16-moment
    variant); the key is not dropped silently."""
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    cfg = _config(2)
    del cfg["zero_optimization"]["offload_optimizer"]
    handler = _Keep(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        engine, *_ = deepspeed_c.initialize(model=_model(), config=cfg)
    finally:
        logger.removeHandler(handler)
    assert any("bf16_optimizer_states" in r and "FusedAdam" in r for r in records), records
    engine.destroy()
