"""engine.offload_states() / reload_states() (DeepSpeed 0.19.8's API) at ZeRO 1/2.

CPU (CI): argument handling as DeepSpeed's (nvme -> ValueError, device none -> no-op, non-ZeRO
optimizers refuse with a message naming the stage), and a full offload/reload cycle in the middle
of training leaves the next steps equal to uninterrupted training (reference: the same engine
config run without the cycle), with every tensor keeping its identity.
CUDA (the GPU machine): the same, plus the device memory the states held is released while they
are offloaded (memory_allocated drops by at least the master + moment + 16-bit parameter bytes)
and every state is back on the GPU afterwards."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import deepspeed_c
from deepspeed_c.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from tests.distributed.engine_models import MLP

pytestmark = pytest.mark.usefixtures("world_of_one")  # in-process initialize: no process group leaks


def _engine(stage: int, dtype: str = "bf16") -> Any:
    torch.manual_seed(0)
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                           "zero_optimization": {"stage": stage}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = deepspeed_c.initialize(model=MLP(d_in=64, hidden=512, d_out=8), config=cfg)
    return engine


def _train(engine: Any, steps: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    dtype = next(engine.module.parameters()).dtype
    out = []
    for _ in range(steps):
        x = torch.randn(4, 64, generator=g).to(engine.device, dtype)
        y = torch.randn(4, 8, generator=g).to(engine.device)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        out.append(float(loss))
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_reload_cycle_keeps_training_exact(stage: int) -> None:
    ref = _engine(stage)
    want = _train(ref, 3, 1) + _train(ref, 3, 2)
    ref.destroy()
    engine = _engine(stage)
    got = _train(engine, 3, 1)
    opt = engine.optimizer
    tensors = list(opt.fp32_partitions) + opt.lp_storage()
    ids = [id(t) for t in tensors]
    before = torch.cuda.memory_allocated() if engine.device.type == "cuda" else 0
    engine.offload_states()
    if engine.device.type == "cuda":
        held = sum(t.numel() * t.element_size() for t in tensors)
        held += sum(v.numel() * v.element_size() for m in opt.fp32_partitions
                    for v in opt.optimizer.state[m].values() if torch.is_tensor(v) and v.dim() > 0)
        assert before - torch.cuda.memory_allocated() >= held, (before, torch.cuda.memory_allocated(), held)
        assert all(t.device.type == "cpu" for t in tensors)
    engine.reload_states()
    assert [id(t) for t in tensors] == ids
    assert all(t.device == engine.device for t in tensors)
    got += _train(engine, 3, 2)
    engine.destroy()
    assert got == want


def test_offload_states_arguments() -> None:
    engine = _engine(2)
    with pytest.raises(ValueError, match="NVMe offload is not supported"):
        engine.offload_states(device=OffloadDeviceEnum.nvme)
    engine.offload_states(device=OffloadDeviceEnum.none)  # DeepSpeed: a warning, nothing moves
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.lp_grads])
    engine.reload_states()
    with pytest.raises(ValueError):
        engine.offload_states(include=["not_a_state"])
    engine.destroy()
    plain = _engine(0)
    with pytest.raises(RuntimeError, match="needs a ZeRO optimizer"):
        plain.offload_states()
    plain.destroy()
