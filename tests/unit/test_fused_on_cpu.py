"""FusedAdam, FusedLion and FusedLamb on host tensors, as DeepSpeed's run on its CPU accelerator: the step goes
to the C CPU kernels. Checked over 5 steps (with a parameter that misses one step) against
torch.optim.AdamW / Adam and a float64 Lion reference, 1e-6 norm-wise relative per tensor (fp32).
And the config's `optimizer.type` on CPU ranks without offload builds them, as DeepSpeed's
`_configure_basic_optimizer` does (DeepSpeedCPUAdam / DeepSpeedCPULion / DeepSpeedCPUAdagrad only
with `offload_optimizer`)."""
from __future__ import annotations

import pytest
import torch

from tests.unit.cuda_reference import lion_ref


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_on_cpu_matches_torch(adam_w_mode):
    from deepspeed_c.ops.adam import FusedAdam

    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(n)) for n in (3, 17, 1030)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    a = FusedAdam(ours, adam_w_mode=adam_w_mode, **hp)
    b = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(theirs, foreach=False, **hp)
    for k in range(5):
        for i, (p, q) in enumerate(zip(ours, theirs)):
            g = None if (k == 2 and i == 1) else torch.randn_like(p)
            p.grad, q.grad = g, None if g is None else g.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs):
        assert _rel(p, q) < 1e-6
        assert a.state[p]["step"].item() == b.state[q]["step"].item()


def test_fused_lion_on_cpu_matches_float64():
    from deepspeed_c.ops.lion import FusedLion

    torch.manual_seed(1)
    ours = [torch.nn.Parameter(torch.randn(n)) for n in (7, 300)]
    ref = [p.detach().double().clone() for p in ours]
    moms = [torch.zeros_like(r) for r in ref]
    opt = FusedLion(ours, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    for _ in range(5):
        for i, p in enumerate(ours):
            p.grad = torch.randn_like(p)
            ref[i], moms[i], _ = lion_ref(ref[i], p.grad.double(), moms[i], lr=1e-2, beta1=0.9, beta2=0.99,
                                          weight_decay=0.1)
        opt.step()
    for p, r in zip(ours, ref):
        assert _rel(p, r) < 1e-6


def test_fused_lamb_on_cpu_matches_float64():
    from deepspeed_c.ops.lamb import FusedLamb
    from tests.unit.cuda_reference import lamb_ref

    torch.manual_seed(2)
    ours = [torch.nn.Parameter(torch.randn(n)) for n in (9, 257)]
    ps = [p.detach().double().clone() for p in ours]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, max_coeff=10.0, min_coeff=0.01)
    opt = FusedLamb(ours, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    for step in range(1, 4):
        for p in ours:
            p.grad = torch.randn_like(p)
        ps, ms, vs, coeffs = lamb_ref(ps, [p.grad for p in ours], ms, vs, step=step, **hp)
        opt.step()
        assert opt.get_lamb_coeffs() == pytest.approx(coeffs, rel=1e-5)
    for p, r in zip(ours, ps):
        assert _rel(p, r) < 1e-6
    with pytest.raises(NotImplementedError, match="scale"):
        opt.step(scale=2.0)


@pytest.mark.parametrize("name,offload,want", [
    ("Adam", False, "FusedAdam"), ("AdamW", False, "FusedAdam"), ("Lion", False, "FusedLion"),
    ("Adagrad", False, "Adagrad"), ("Adam", True, "DeepSpeedCPUAdam"), ("Lion", True, "DeepSpeedCPULion"),
    ("Adagrad", True, "DeepSpeedCPUAdagrad")])
def test_config_builds_deepspeeds_optimizer_on_cpu(name, offload, want):
    from deepspeed_c.runtime.config.optim import normalize_optimizer_name
    from deepspeed_c.runtime.optimizer_factory import build_optimizer

    params = [torch.nn.Parameter(torch.zeros(4))]
    opt = build_optimizer(normalize_optimizer_name(name), {"lr": 1e-3}, params, torch.device("cpu"),
                          cpu_optimizer=offload)
    assert type(opt).__name__ == want
