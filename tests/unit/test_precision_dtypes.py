"""Precision and dtype rules of the engine (issue 12 item 4, issue 24 items 4 and 9): data_types
buffer_dtype / grad_accum_dtype and the bf16 stage-0 gradient accumulation, each against a plain
PyTorch reference that accumulates in the stated dtype."""
from __future__ import annotations

import pytest
import torch

import deepspeed_c
from tests.distributed.engine_models import MLP


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    import torch.distributed as dist

    started = not dist.is_initialized()
    yield
    if started and dist.is_initialized():
        dist.destroy_process_group()


class WithBuffer(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running", torch.linspace(0.1, 1.0, 12, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * self.running.to(x.dtype))


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                        ("fp32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_buffer_dtype_casts_buffers(name, dtype):
    """DeepSpeed accepts any DtypeEnum spelling in data_types.buffer_dtype; initialize must not hand the
    raw string to Tensor.to (it crashed with "Invalid device string: bf16"). Buffers end in that dtype,
    values equal to the fp32 buffer rounded once (exact)."""
    torch.manual_seed(0)
    model = WithBuffer()
    want = model.running.detach().clone().to(dtype)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "bf16": {"enabled": True}, "data_types": {"buffer_dtype": name}}
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    assert engine.module.running.dtype == dtype
    assert torch.equal(engine.module.running, want)
    loss = engine(torch.randn(2, 12).bfloat16()).float().square().mean()
    engine.backward(loss)
    engine.step()
