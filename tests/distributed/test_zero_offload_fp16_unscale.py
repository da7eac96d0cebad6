"""fp16 + ZeRO-Offload unscales gradients in fp32, as DeepSpeed does (issue 12 item 4).

The host step used to multiply the fp16 gradient partition by 1/loss_scale in fp16 storage: a
gradient of ~2e-7 is subnormal there (spacing 6e-8), so it came back up to ~15% off or zero. Model:
one linear layer whose exact gradient is 2e-7 * sum(x) (loss = 2e-7 * out.sum()), static loss scale
2^16, Adam with eps = 1e-2 so the first update is lr * g / (|g| + eps), proportional to g.
Reference: that update in float64 from the exact gradient. Tolerance 3e-3 norm-wise relative (the
scaled fp16 gradient itself carries 2^-11 = 4.9e-4 rounding). 1 and 2 gloo ranks, stages 1 and 2."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.harness import run_distributed

LR, EPS, SCALE, N = 1e-3, 1e-2, 2e-7, 4


def body(rank: int, world: int, stage: int) -> dict:
    import deepspeed_c

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4, bias=False)
    with torch.no_grad():
        model.weight.zero_()  # the update (~2e-8) is then exact in the fp32 master, not lost in its rounding
    w0 = model.weight.detach().double().numpy().copy()
    cfg = {"train_micro_batch_size_per_gpu": N, "steps_per_print": 10**9, "gradient_clipping": 0.0,
           "fp16": {"enabled": True, "loss_scale": 65536},
           "optimizer": {"type": "Adam", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.0}},
           "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg, model_parameters=model.parameters())
    g = torch.Generator().manual_seed(1)
    x = torch.rand(N * world, 16, generator=g) + 0.5
    out = engine(x[rank * N:(rank + 1) * N].half().to(engine.device))
    engine.backward(out.float().sum() * SCALE / N)  # mean over the micro-batch of SCALE * row sums
    engine.step()
    from deepspeed_c.utils import safe_get_full_fp32_param

    w1 = safe_get_full_fp32_param(engine.module.weight).double().cpu().numpy()
    return {"w0": w0, "w1": w1, "x": x.double().numpy()}


@pytest.mark.parametrize("world,stage", [(1, 2), (2, 1), (2, 2)])
def test_fp16_offload_unscales_in_fp32(world, stage):
    res = run_distributed(body, world, args=(stage,), timeout=180)
    r = res[0]
    # d/dW of mean_ranks( SCALE/N * sum(W x) ) = SCALE/(N*world) * sum over all rows of x, same for every output
    grad = np.tile(SCALE / (N * world) * r["x"].sum(axis=0), (4, 1))
    want = -LR * grad / (np.abs(grad) + EPS)
    got = r["w1"] - r["w0"]
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 3e-3, f"update rel err {err:.2e}"
