"""`graph_harvesting` (runtime/graph_harvesting.py) where it can be checked without a GPU: the key is accepted;
where the step cannot be recorded (no CUDA device here; fp32; a ZeRO stage) initialize warns once, naming the
key and why, and training gives exactly the losses and weights of the same run without the key. The recorded
step itself (replayed CUDA graph = eager step, bit for bit; re-recorded when the lr changes) is checked on a GPU
by benchmarks/graph_harvesting.py (.devrun/gpu_46.sh)."""
from __future__ import annotations

import io
import logging

import pytest
import torch

import deepspeed_c
from tests.distributed.engine_models import MLP

pytestmark = pytest.mark.usefixtures("world_of_one")

BASE = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9, "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}}


def _train(cfg: dict) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = MLP()
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg, model_parameters=model.parameters())
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(5):
        x = torch.randn(4, 12, generator=g).to(engine.precision.model_dtype)
        y = torch.randn(4, 3, generator=g).to(x.dtype)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y.float())
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses, [p.detach().float().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("extra", [{"bf16": {"enabled": True}}, {},
                                   {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}],
                         ids=["bf16-stage0", "fp32", "bf16-zero1"])
def test_key_accepted_warns_why_and_trains_the_same(extra: dict) -> None:
    from deepspeed_c.utils.logging import logger

    off = _train(dict(BASE, **extra))
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)  # the package's logger does not propagate to pytest's
    try:
        on = _train(dict(BASE, **extra, graph_harvesting=True))
    finally:
        logger.removeHandler(handler)
    msgs = [m for m in stream.getvalue().splitlines() if "'graph_harvesting'" in m]
    assert len(msgs) == 1 and "no effect" in msgs[0], msgs
    assert ("CUDA" in msgs[0]) if extra == {"bf16": {"enabled": True}} else ("stage 0" in msgs[0])
    assert on[0] == off[0]
    for a, b in zip(on[1], off[1]):
        assert torch.equal(a, b)


def test_bad_value_names_the_key() -> None:
    from deepspeed_c.runtime.config import DeepSpeedConfig

    with pytest.raises(Exception, match="graph_harvesting"):
        DeepSpeedConfig(dict(BASE, graph_harvesting="yes"))
