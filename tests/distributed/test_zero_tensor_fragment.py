"""deepspeed_c.utils.safe_get_full_* / safe_set_full_* / safe_*_local_* on ZeRO stages 1 and 2 (2 gloo
ranks) against single-process float64 PyTorch: the full gradient after an accumulation-boundary backward
is the global-batch gradient, the fp32 master is the model parameter, Adam's moments after one step are
(1 - beta1) g and (1 - beta2) g^2; the local pieces of all ranks together are the whole parameter; the
setters write what the getters then read."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.distributed.engine_models import loss_fn, make_batches, make_model
from tests.harness import run_distributed

MICRO = 2


def body(rank: int, world: int, stage: int) -> dict[str, Any]:
    import deepspeed_c
    import torch.distributed as dist
    from deepspeed_c import utils

    model = make_model("mlp", seed=7)
    ref = make_model("mlp", seed=7).double()
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**9, "gradient_clipping": 0.0,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.999]}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 100}}
    engine, _, _, _ = deepspeed_c.initialize(model=model, config=config)
    x, y = make_batches("mlp", 1, MICRO * world, seed=11)[0]
    lo, hi = rank * MICRO, (rank + 1) * MICRO
    dev = engine.device
    engine.backward(loss_fn(engine(x[lo:hi].to(dev)), y[lo:hi].to(dev)))
    loss_fn(ref(x.double()), y.double()).backward()
    out: dict[str, Any] = {"grad_err": [], "master_err": [], "m_err": [], "v_err": [], "local": [], "set_err": []}
    params = list(model.parameters())
    for p, r in zip(params, ref.parameters()):
        g = utils.safe_get_full_grad(p).cpu()
        out["grad_err"].append(float((g.double() - r.grad).norm() / r.grad.norm()))
    engine.step()
    for p, r in zip(params, ref.parameters()):
        out["master_err"].append(float((utils.safe_get_full_fp32_param(p) - p.detach()).abs().max().cpu()))
        m = utils.safe_get_full_optimizer_state(p, "exp_avg").double().cpu()
        v = utils.safe_get_full_optimizer_state(p, "exp_avg_sq").double().cpu()
        out["m_err"].append(float((m - 0.1 * r.grad).norm() / (0.1 * r.grad).norm()))
        out["v_err"].append(float((v - 0.001 * r.grad**2).norm() / (0.001 * r.grad**2).norm()))
        local = utils.safe_get_local_fp32_param(p)
        pieces: list[Any] = [None] * world
        dist.all_gather_object(pieces, local.cpu().numpy())
        whole = np.sort(np.concatenate(pieces))
        out["local"].append(bool(np.array_equal(whole, np.sort(p.detach().reshape(-1).cpu().numpy()))))
    # setters: full, then local, read back through the full getters
    p = params[2]
    target = (torch.arange(p.numel(), dtype=torch.float32).view(p.shape) / 7.0).to(dev)
    utils.safe_set_full_fp32_param(p, target)
    got = utils.safe_get_full_fp32_param(p)
    engine.optimizer.refresh_model_params()
    out["set_err"].append(float((got - target).abs().max()))
    out["set_err"].append(float((p.detach() - target).abs().max()))
    local_m = utils.safe_get_local_optimizer_state(p, "exp_avg")
    utils.safe_set_local_optimizer_state(p, torch.full_like(local_m, 3.0), "exp_avg")
    out["set_err"].append(float((utils.safe_get_full_optimizer_state(p, "exp_avg") - 3.0).abs().max()))
    utils.safe_set_full_optimizer_state(p, target, "exp_avg_sq")
    out["set_err"].append(float((utils.safe_get_full_optimizer_state(p, "exp_avg_sq") - target).abs().max()))
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_safe_accessors_match_reference(stage: int) -> None:
    for res in run_distributed(body, 2, args=(stage,), timeout=300):
        assert max(res["grad_err"]) < 1e-5
        assert max(res["master_err"]) == 0.0
        assert max(res["m_err"]) < 1e-5
        assert max(res["v_err"]) < 1e-4
        assert all(res["local"])
        assert max(res["set_err"]) == 0.0


def test_unpartitioned_param_has_no_state() -> None:
    from deepspeed_c import utils

    p = torch.nn.Parameter(torch.ones(3))
    assert utils.safe_get_full_fp32_param(p) is None
    assert utils.safe_get_local_grad(p) is None
    with pytest.raises(ValueError, match="not partitioned"):
        utils.safe_set_full_fp32_param(p, torch.zeros(3))
