"""ZeRO-2 + CPU offload on one GPU: the gradients staged to the host equal the no-offload run's
reduced gradient partitions, bit for bit, under load (issue 12 item 3).

At world size 1 no collective orders the side stream (which copies each finished gradient bucket
to pinned host memory) after the compute stream (which zero-fills and writes the bucket), so the
copy could read the bucket before it was written: two identical runs gave different losses from
the third step. In each trial every layer's backward first queues heavy matmuls on the compute
stream (so it lags the host while buckets are handed off), and one backward runs on identical weights in an offload engine and a no-offload engine, and compares the staged
host gradients and both device partitions element for element: 0 mismatches in 50 trials."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the stream race needs a CUDA GPU")

TRIALS = 50


class _Lag(torch.autograd.Function):
    """Identity whose backward first queues heavy matmuls on the compute stream, so that stream lags
    the host by milliseconds while the gradient buckets behind it are written."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        load = torch.ones(4096, 4096, device=grad.device, dtype=torch.bfloat16)
        for _ in range(6):
            load = load @ load * 2.0**-12
        return grad + load[0, 0] * 0  # depends on the load: the layers' gradients queue behind it


class _Stack(torch.nn.Module):
    def __init__(self, d: int = 1024, layers: int = 8) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = _Lag.apply(torch.tanh(layer(x)))
        return x.float().pow(2).mean()


def _engine(offload: bool):
    import deepspeed_c

    torch.manual_seed(0)
    model = _Stack()
    # buckets of about two layers: several hand-offs to the side stream during backward
    zero = {"stage": 2, "reduce_bucket_size": int(2.2e6), "allgather_bucket_size": int(2.2e6)}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    cfg = {"train_micro_batch_size_per_gpu": 64, "steps_per_print": 10**9, "bf16": {"enabled": True},
           "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": zero}
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def test_staged_gradients_match_no_offload_bit_for_bit():
    a, b = _engine(True), _engine(False)
    g = torch.Generator(device="cuda").manual_seed(1)
    mismatches = 0
    for trial in range(TRIALS):
        x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
        for engine in (a, b):
            engine.backward(engine(x))
        torch.cuda.synchronize()
        staged = a.optimizer.offload._host_grads()  # what the host step would consume
        for gi, host in enumerate(staged):
            ref = b.optimizer.reducer.grad_partitions[gi].cpu()
            dev = a.optimizer.reducer.grad_partitions[gi].cpu()
            mismatches += int((host.view(torch.int16) != ref.view(torch.int16)).sum())
            mismatches += int((dev.view(torch.int16) != ref.view(torch.int16)).sum())
        a.optimizer.zero_grad()
        b.optimizer.zero_grad()
    assert mismatches == 0, f"{mismatches} gradient elements differ from the no-offload run over {TRIALS} trials"
