"""Which (ZeRO stage, model dtype, data_types.grad_accum_dtype) triples initialize accepts, as DeepSpeed
0.19.8 (issue 49 item 3; the matrix of its tests/unit/runtime/test_ds_initialize.py
TestOptimizerImplementation, amp aside): under ZeRO 1/2/3 every pair; without ZeRO only the model's own
dtype (or none), every other pair raising NotImplementedError, bf16 with fp32 included (DeepSpeed's
BF16_Optimizer serves that pair at stage 1 only). The message names the keys. A pipeline keeps bf16 with
fp32 accumulation at stage 0 (README: differences), see tests/distributed/test_pipe_parity.py."""
from __future__ import annotations

import pytest
import torch

import deepspeed_c
from tests.distributed.engine_models import MLP, loss_fn

pytestmark = pytest.mark.usefixtures("world_of_one")

STAGE0_SUPPORTED = {("fp16", None), ("fp16", "fp16"), ("bf16", None), ("bf16", "bf16"), ("fp32", None),
                    ("fp32", "fp32")}


def _config(stage: int, model_dtype: str, accum, optimizer: bool = True) -> dict:
    cfg = {"train_batch_size": 1, "gradient_clipping": 0.0, "steps_per_print": 10**9,
           "fp16": {"enabled": model_dtype == "fp16"}, "bf16": {"enabled": model_dtype == "bf16"},
           "zero_optimization": {"stage": stage}, "data_types": {"grad_accum_dtype": accum}}
    if optimizer:
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3}}
    return cfg


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("model_dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("accum", [None, "fp16", "bf16", "fp32"])
def test_optimizer_implementation_matrix(stage, model_dtype, accum):
    torch.manual_seed(0)
    model = MLP()
    cfg = _config(stage, model_dtype, accum)
    if stage > 0 or (model_dtype, accum) in STAGE0_SUPPORTED:
        engine, *_ = deepspeed_c.initialize(model=model, config=cfg, model_parameters=list(model.parameters()))
        engine.destroy()
    else:
        with pytest.raises(NotImplementedError):
            deepspeed_c.initialize(model=model, config=cfg, model_parameters=list(model.parameters()))


def test_bf16_fp32_at_stage0_names_the_keys():
    with pytest.raises(NotImplementedError) as e:
        deepspeed_c.initialize(model=MLP(), config=_config(0, "bf16", "fp32"))
    msg = str(e.value)
    assert msg.startswith("unsupported mix of model_dtype=torch.bfloat16 and grad_accum_dtype=torch.float32"), msg
    for key in ("data_types.grad_accum_dtype", "bf16.enabled", "zero_optimization.stage"):
        assert key in msg, msg


def test_bf16_fp32_at_stage0_without_an_optimizer_is_accepted():
    """DeepSpeed checks the pair when it builds the optimizer; an engine without one (inference-style
    forward) starts."""
    engine, *_ = deepspeed_c.initialize(model=MLP().bfloat16(), config=_config(0, "bf16", "fp32", optimizer=False))
    out = engine(torch.randn(2, 12).bfloat16())
    assert out.dtype == torch.bfloat16
    engine.destroy()


def test_bf16_fp32_at_stage1_trains():
    torch.manual_seed(0)
    model = MLP()
    cfg = _config(1, "bf16", "fp32")
    cfg["train_batch_size"] = 2
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    x, y = torch.randn(2, 12).bfloat16(), torch.randn(2, 3).bfloat16()
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    engine.destroy()
