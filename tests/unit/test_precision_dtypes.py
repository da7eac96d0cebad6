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


@pytest.mark.parametrize("offload", [False, True])
def test_fp16_offload_unscales_in_fp32(offload):
    """DeepSpeed's ZeRO-Offload unscales fp16 gradients in fp32 (the CPU Adam reads the fp16 gradient
    and divides by the loss scale in fp32): gradients of 1e-9..1e-6 scaled by 2**16 are representable
    in fp16, but unscaled in fp16 they flush to zero or lose up to ~19%. Reference: float64 Adam on the
    fp32 master with grad = fp16(scaled grad) / scale. Tolerance: 1e-5 norm-wise relative on the update
    (eps = 1e-6 keeps the Adam update nearly linear in each gradient, so a 1e-3 relative gradient error
    shows as ~1e-3 in the update; the small fp32 masters keep their rounding near 1e-7)."""
    from deepspeed_c.ops.adam import DeepSpeedCPUAdam
    from deepspeed_c.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed_c.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    scale = 2.0 ** 16
    n = 64
    w = torch.nn.Parameter(torch.linspace(-0.01, 0.01, n).half())
    tiny = torch.logspace(-9, -6, n, dtype=torch.float64) * torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)
    lr, eps = 1e-2, 1e-6  # eps above every |g|: the update is ~linear in g, so gradient errors show
    if offload:
        opt = DeepSpeedCPUAdam([w], lr=lr, eps=eps, adamw_mode=False)
    else:
        opt = torch.optim.Adam([w], lr=lr, eps=eps)
    zopt = DeepSpeedZeroOptimizer(
        opt, stage=2, rank=0, world_size=1, should_reduce=lambda: True, is_boundary=lambda: True,
        loss_scaler=CreateLossScaler(torch.float16, scale, False, None), check_overflow=True,
        offload_device="cpu" if offload else None, offload_sub_chunk=16, offload_stage_on_host=offload)
    zopt.note_backward_scale(scale)
    start = zopt.fp32_partitions[0].detach().double()[:n].clone()
    (w.float() * (tiny * scale).float()).sum().backward()
    g16 = (tiny * scale).half()  # the fp16 gradient autograd produced
    zopt.step()
    ref_master = start.clone().requires_grad_(True)
    ref = torch.optim.Adam([ref_master], lr=lr, eps=eps)
    ref_master.grad = g16.double() / scale
    ref.step()
    got = zopt.fp32_partitions[0].detach().double()[:n] - start
    want = ref_master.detach() - start
    rel = float((got - want).norm() / want.norm())
    assert rel < 1e-5, (rel, got[:6].tolist(), want[:6].tolist(), got[-4:].tolist(), want[-4:].tolist())
