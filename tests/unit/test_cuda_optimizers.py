"""GPU tests of FusedAdam, FusedLamb and FusedLion against float64 references (several steps,
ragged and misaligned tensors, fp32/fp16/bf16 parameters, lists longer than one launch), their
state's compatibility with torch.optim.AdamW, and DeepSpeed's argument behaviour."""
from __future__ import annotations

import random

import pytest
import torch

from tests.unit.cuda_reference import (NEEDS_GPU, RAGGED, adam_ref, assert_half_close, assert_rel, lamb_ref, lion_ref,
                                       make, poison)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_GPU)


def _params(sizes, dtype, misalign=False):
    return [torch.nn.Parameter(t) for t in make(sizes, dtype, misalign=misalign)]


def _set_grads(params, scale=1.0):
    for p in params:
        p.grad = (torch.randn(p.numel(), device="cuda") * scale).to(p.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("bias_correction", [True, False], ids=["bc", "nobc"])
def test_fused_adam_matches_float64(dtype, adam_w_mode, bias_correction):
    from deepspeed_c.ops.adam import FusedAdam

    params = _params(RAGGED, dtype) + _params(RAGGED[:8], dtype, misalign=True)
    hp = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    opt = FusedAdam(params, adam_w_mode=adam_w_mode, bias_correction=bias_correction, **hp)
    ref_p = [p.detach().double() for p in params]
    ref_m = [torch.zeros_like(r) for r in ref_p]
    ref_v = [torch.zeros_like(r) for r in ref_p]
    for step in range(1, 4):
        _set_grads(params)
        for i, p in enumerate(params):
            # the reference starts from the parameter as stored (rounded for fp16/bf16)
            ref_p[i], ref_m[i], ref_v[i] = adam_ref(p.detach(), p.grad, ref_m[i], ref_v[i], lr=hp["lr"],
                                                    beta1=0.9, beta2=0.99, eps=hp["eps"], step=step,
                                                    weight_decay=hp["weight_decay"], adam_w_mode=adam_w_mode,
                                                    bias_correction=bias_correction)
        opt.step()
        if dtype == torch.float32:
            assert_rel([p.detach() for p in params], ref_p, 1e-5, "param")
        else:
            assert_half_close([p.detach() for p in params], ref_p, "param")
        assert_rel([opt.state[p]["exp_avg"] for p in params], ref_m, 1e-5, "exp_avg")
        assert_rel([opt.state[p]["exp_avg_sq"] for p in params], ref_v, 1e-5, "exp_avg_sq")
        ref_m = [opt.state[p]["exp_avg"].double() for p in params]  # continue from the kernel's state
        ref_v = [opt.state[p]["exp_avg_sq"].double() for p in params]
    assert all(opt.state[p]["step"].item() == 3.0 for p in params)
    assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in params)


def test_fused_adam_mixed_dtypes_many_tensors_side_stream():
    from deepspeed_c.ops.adam import FusedAdam
    from deepspeed_c.ops.cuda_multi_tensor import tensors_per_launch

    n = tensors_per_launch(5) + 300
    sizes = [random.randint(0, 200) for _ in range(n)]
    params = _params(sizes, torch.float32) + _params(sizes[:50], torch.bfloat16)
    random.shuffle(params)
    _set_grads(params)
    before = [p.detach().clone() for p in params]
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # runs on torch's current stream, whichever it is
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    for p, b in zip(params, before):
        ref, _, _ = adam_ref(b, p.grad, torch.zeros_like(b), torch.zeros_like(b), lr=1e-2, beta1=0.9, beta2=0.999,
                             eps=1e-8, step=1, weight_decay=0.1)
        if p.dtype == torch.float32:
            assert_rel([p.detach()], [ref], 1e-5, "param")
        else:
            assert_half_close([p.detach()], [ref], "param")


def test_fused_adam_equals_torch_adamw_and_state_round_trips():
    from deepspeed_c.ops.adam import FusedAdam

    sizes = [1000, 17, 65537, 3]
    ours = _params(sizes, torch.float32)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)
    a, b = FusedAdam(ours, **hp), torch.optim.AdamW(theirs, foreach=False, **hp)

    def step_both():
        _set_grads(ours)
        for p, q in zip(ours, theirs):
            q.grad = p.grad.clone()
        a.step()
        b.step()

    for _ in range(4):
        step_both()
    assert_rel([p.detach() for p in ours], [q.detach().double() for q in theirs], 1e-5, "FusedAdam vs AdamW")
    # FusedAdam state -> torch AdamW, and the reverse; both keep training in agreement
    b2 = torch.optim.AdamW(theirs, **hp)
    b2.load_state_dict(a.state_dict())
    a2 = FusedAdam(ours, **hp)
    a2.load_state_dict(b.state_dict())
    a, b = a2, b2
    for _ in range(2):
        step_both()
    assert_rel([p.detach() for p in ours], [q.detach().double() for q in theirs], 1e-5, "after state exchange")
    assert all(a.state[p]["step"].item() == 6.0 for p in ours)


def test_fused_adam_load_keeps_fp32_moments_for_bf16_params():
    from deepspeed_c.ops.adam import FusedAdam

    params = _params([333, 5], torch.bfloat16)
    opt = FusedAdam(params)
    _set_grads(params)
    opt.step()
    sd = opt.state_dict()
    opt2 = FusedAdam(params)
    opt2.load_state_dict(sd)
    for p in params:
        assert opt2.state[p]["exp_avg"].dtype == torch.float32
        assert torch.equal(opt2.state[p]["exp_avg"], opt.state[p]["exp_avg"])


def test_fused_adam_deepspeed_arguments():
    from deepspeed_c.ops.adam import FusedAdam

    params = _params([10], torch.float32)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(params, amsgrad=True)
    opt = FusedAdam(params)
    with pytest.raises(RuntimeError, match="has been updated"):
        opt.step(scale=2.0)
    _set_grads(params)
    opt.zero_grad()
    assert params[0].grad is None
    opt = FusedAdam(params, set_grad_none=False)
    _set_grads(params)
    opt.zero_grad()
    assert params[0].grad is not None and not params[0].grad.any()
    # host parameters are stepped by the C CPU kernel (tests/unit/test_fused_on_cpu.py)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
def test_fused_lamb_matches_float64(dtype, eps_inside_sqrt):
    from deepspeed_c.ops.lamb import FusedLamb

    sizes = [s for s in RAGGED] + [2, 9]
    params = _params(sizes, dtype) + _params([100, 7], dtype, misalign=True)
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_coeff=10.0, min_coeff=0.01)
    opt = FusedLamb(params, eps_inside_sqrt=eps_inside_sqrt, max_grad_norm=1.0, **hp)
    ms = [torch.zeros(p.numel(), dtype=torch.float64, device="cuda") for p in params]
    vs = [torch.zeros_like(m) for m in ms]
    for step in range(1, 3):
        _set_grads(params, scale=64.0)
        scale = 64.0
        norm = torch.stack([p.grad.double().norm() for p in params]).norm().item()
        combined = scale
        clip = (norm / scale + 1e-6) / 1.0
        if clip > 1:
            combined = clip * scale
        ref_p, ref_m, ref_v, ref_c = lamb_ref(
            [p.detach() for p in params], [p.grad for p in params], ms, vs, lr=hp["lr"], beta1=0.9, beta2=0.999,
            eps=hp["eps"], step=step, weight_decay=hp["weight_decay"], max_coeff=10.0, min_coeff=0.01,
            eps_inside_sqrt=eps_inside_sqrt, grad_scale=combined)
        opt.step(scale=scale, grad_norms=[norm])
        if dtype == torch.float32:
            assert_rel([p.detach() for p in params], ref_p, 1e-5, "param")
        else:
            assert_half_close([p.detach() for p in params], ref_p, "param")
        assert_rel([opt.state[p]["exp_avg"] for p in params], ref_m, 1e-5, "exp_avg")
        assert_rel([opt.state[p]["exp_avg_sq"] for p in params], ref_v, 1e-5, "exp_avg_sq")
        coeffs = opt.get_lamb_coeffs()
        nonempty = [i for i, p in enumerate(params) if p.numel()]
        got = torch.tensor([coeffs[i] for i in range(len(params))], dtype=torch.float64)
        want = torch.tensor(ref_c, dtype=torch.float64)
        assert torch.allclose(got[nonempty], want[nonempty], rtol=1e-5), (got, want)
        ms = [opt.state[p]["exp_avg"].double() for p in params]
        vs = [opt.state[p]["exp_avg_sq"].double() for p in params]


def test_fused_lamb_output_params_and_many_tensors():
    from deepspeed_c.ops.cuda_multi_tensor import tensors_per_launch
    from deepspeed_c.ops.lamb import FusedLamb

    sizes = [random.randint(1, 300) for _ in range(tensors_per_launch(5) + 100)]
    params = _params(sizes, torch.float32)
    outs = poison([torch.empty(p.numel(), dtype=torch.float16, device="cuda") for p in params])
    grads = [torch.randn(p.numel(), device="cuda").half() for p in params]
    before = [p.detach().clone() for p in params]
    opt = FusedLamb(params, lr=1e-2, weight_decay=0.0)
    opt.step(grads=grads, output_params=outs, scale=4.0)
    zeros = [torch.zeros(p.numel(), dtype=torch.float64, device="cuda") for p in params]
    ref_p, _, _, ref_c = lamb_ref(before, grads, zeros, zeros, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, step=1,
                                  weight_decay=0.0, max_coeff=10.0, min_coeff=0.01, grad_scale=4.0)
    assert_rel([p.detach() for p in params], ref_p, 1e-5, "param")
    for p, o in zip(params, outs):
        assert torch.equal(o, p.detach().half())
    assert torch.allclose(torch.tensor(opt.get_lamb_coeffs(), dtype=torch.float64),
                          torch.tensor(ref_c, dtype=torch.float64), rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_lion_matches_float64(dtype):
    from deepspeed_c.ops.cuda_multi_tensor import tensors_per_launch
    from deepspeed_c.ops.lion import FusedLion

    sizes = RAGGED + [random.randint(0, 50) for _ in range(tensors_per_launch(4))]
    params = _params(sizes, dtype) + _params([33, 5000], dtype, misalign=True)
    opt = FusedLion(params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    ms = [torch.zeros(p.numel(), dtype=torch.float64, device="cuda") for p in params]
    for _ in range(3):
        _set_grads(params)
        refs = [lion_ref(p.detach(), p.grad, m, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
                for p, m in zip(params, ms)]
        opt.step()
        for i, p in enumerate(params):
            ref_p, ref_m, c = refs[i]
            # where c is within fp32 rounding of 0 the sign is legitimately either way
            tie = c.abs() < 1e-6
            got = torch.where(tie, ref_p, p.detach().double())
            if dtype == torch.float32:
                assert_rel([got], [ref_p], 1e-5, f"param {i}")
            else:
                assert_half_close([got.to(dtype)], [ref_p], f"param {i}")
            assert_rel([opt.state[p]["exp_avg"]], [ref_m], 1e-5, f"exp_avg {i}")
        ms = [opt.state[p]["exp_avg"].double() for p in params]
    with pytest.raises(RuntimeError, match="has been updated"):
        opt.step(grads=[])
