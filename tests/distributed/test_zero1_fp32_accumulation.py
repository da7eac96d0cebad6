"""ZeRO stage 1 with bf16 parameters and `data_types.grad_accum_dtype: "fp32"` (DeepSpeed routes this
case to its BF16_Optimizer: every micro-step's gradient is accumulated in fp32 and the fp32 sums are
reduced at the boundary). Was NotImplementedError.

2 gloo ranks, 8 micro-steps per step, 2 steps, SGD. Reference, in-process: the same bf16 model runs
each rank's micro-batches (loss / 8, as engine.backward scales it), its bf16 gradients are summed in
fp32 per rank, averaged over ranks in fp32, and applied to fp32 masters. Tolerance 1e-6 norm-wise
relative per tensor on the masters; a reference that sums in bf16 differs from it by more than 1e-4
here (checked), so bf16 accumulation would fail."""
from __future__ import annotations

import numpy as np
import torch

from tests.distributed.engine_models import MLP
from tests.harness import run_distributed

GAS, MICRO, STEPS, LR = 8, 2, 2, 0.1


def _batches(world: int) -> list:
    g = torch.Generator().manual_seed(9)
    return [(torch.randn(MICRO * world, 12, generator=g), torch.randn(MICRO * world, 3, generator=g))
            for _ in range(GAS * STEPS)]


def body(rank: int, world: int) -> list:
    import deepspeed_c
    from deepspeed_c.utils import safe_get_full_fp32_param

    torch.manual_seed(0)
    model = MLP()
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**9,
           "gradient_clipping": 0.0, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
           "zero_allow_untested_optimizer": True, "optimizer": {"type": "SGD", "params": {"lr": LR}},
           "zero_optimization": {"stage": 1}}
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg, model_parameters=model.parameters())
    for x, y in _batches(world):
        sl = slice(rank * MICRO, (rank + 1) * MICRO)
        out = engine(x[sl].to(engine.device, torch.bfloat16))
        engine.backward(torch.nn.functional.mse_loss(out.float(), y[sl].to(engine.device)))
        engine.step()
    return [safe_get_full_fp32_param(p).double().cpu().numpy() for p in engine.module.parameters()]


def reference(world: int, accum: torch.dtype) -> list:
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    masters = [p.detach().float().clone() for p in model.parameters()]
    data = _batches(world)
    for s in range(STEPS):
        total = [torch.zeros_like(m) for m in masters]
        for r in range(world):
            acc = [torch.zeros_like(m, dtype=accum) for m in masters]
            for x, y in data[s * GAS:(s + 1) * GAS]:
                sl = slice(r * MICRO, (r + 1) * MICRO)
                model.zero_grad()
                (torch.nn.functional.mse_loss(model(x[sl].to(torch.bfloat16)).float(), y[sl]) / GAS).backward()
                acc = [a + p.grad.to(accum) for a, p in zip(acc, model.parameters())]
            total = [t + a.float() for t, a in zip(total, acc)]
        with torch.no_grad():
            for m, t, p in zip(masters, total, model.parameters()):
                m -= LR * t / world
                p.copy_(m)
    return [m.double().numpy() for m in masters]


def test_zero1_bf16_accumulates_in_fp32():
    res = run_distributed(body, 2, timeout=180)
    ref32, ref16 = reference(2, torch.float32), reference(2, torch.bfloat16)
    worst16 = max(np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(ref16, ref32))
    assert worst16 > 1e-4, f"the test cannot tell bf16 from fp32 accumulation ({worst16:.1e})"
    for got, want in zip(res[0], ref32):
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < 1e-6, f"rel err {err:.2e}"
