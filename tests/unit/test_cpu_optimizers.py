"""The C CPU optimizers against float64 references: every optimizer, every supported (param, state)
dtype pair, every SIMD path this CPU runs, lengths with vector tails, 10 steps.

Each step's reference starts from the kernel's own tensors before that step (float64 math, then
rounding to each operand's storage dtype), so a one-ulp rounding difference in one step cannot
snowball into later ones; test_front_ends_match_torch_optim checks 10 uninterrupted steps
against torch.optim in fp32."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed_c.ops.adam import DeepSpeedCPUAdam
from deepspeed_c.ops.adam.cpu_adam import cpu_adam_step
from deepspeed_c.ops.lion import DeepSpeedCPULion
from deepspeed_c.ops.op_builder import CPUAdagradBuilder, CPUAdamBuilder, CPULionBuilder, toolchain
from tests.unit.cpu_optim_reference import adagrad_ref, adam_ref, assert_rel, assert_within_one_ulp, lion_ref

SIMD_PATHS = [s for s in ("avx512", "avx2", "scalar") if not toolchain.missing_isa(s)]
PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
         (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]
SIZES = (1, 3, 15, 16, 17, 31, 1023, 1024, 1025, 2500)  # tails of 8/16-wide vectors and of the 1024 tile
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def fresh(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype) for n in SIZES]


def check(got, want, dtype, what, scale=None):
    """fp32: norm-wise relative 1e-6. A state of 1 or 3 elements can be a near-cancellation
    (beta * m + (1 - beta) * g close to 0), where no fp32 arithmetic is relatively accurate;
    those are held to 1e-6 of the operands' magnitude (`scale`) instead. Low precision: one ulp
    of the reference rounded to the storage dtype."""
    if dtype != torch.float32:
        assert_within_one_ulp(got, want.to(dtype), what, scale)
    elif got.numel() >= 15 or scale is None:
        assert_rel(got, want.float(), 1e-6, what)
    else:
        bound = 1e-6 * torch.maximum(want.double().abs(), scale.double().abs())
        assert bool(((got.double() - want.double()).abs() <= bound).all()), what


@pytest.mark.parametrize("simd", SIMD_PATHS)
@pytest.mark.parametrize("pdt,sdt", PAIRS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("adamw,wd", [(True, 0.0), (True, 0.1), (False, 0.1)], ids=["adamw", "adamw-wd", "adam-l2"])
def test_adam(simd, pdt, sdt, adamw, wd):
    op = CPUAdamBuilder(simd=simd).load()
    assert op.simd() == simd
    params = fresh(pdt, 1)
    ms = [torch.zeros(p.numel(), dtype=sdt) for p in params]
    vs = [torch.zeros(p.numel(), dtype=sdt) for p in params]
    for step in range(1, 11):
        grads = fresh(pdt, 100 + step)
        ref = [(p.clone(), m.clone(), v.clone()) for p, m, v in zip(params, ms, vs)]
        op.adam_step(params, grads, ms, vs, None, HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], wd, step, 1,
                     int(adamw))
        new_ref = []
        for (rp, rm, rv), g in zip(ref, grads):
            p64, m64, v64 = adam_ref(rp, g, rm, rv, wd=wd, step=step, adamw=adamw, **HP)
            new_ref.append((p64.to(pdt), m64.to(sdt), v64.to(sdt)))  # storage rounding every step
        scales = [rm.double().abs() + g.double().abs() + rp.double().abs() for (rp, rm, _), g in zip(ref, grads)]
        pscales = [rp.double().abs() + 10 * HP["lr"] for rp, _, _ in ref]
        ref = new_ref
        for i, (p, m, v) in enumerate(zip(params, ms, vs)):
            check(p, ref[i][0], pdt, f"step {step} param {i}", pscales[i])
            check(m, ref[i][1], sdt, f"step {step} exp_avg {i}", scales[i])
            check(v, ref[i][2], sdt, f"step {step} exp_avg_sq {i}")


@pytest.mark.parametrize("simd", SIMD_PATHS)
@pytest.mark.parametrize("pdt,sdt", PAIRS, ids=lambda d: str(d).removeprefix("torch."))
def test_adagrad(simd, pdt, sdt):
    op = CPUAdagradBuilder(simd=simd).load()
    params = fresh(pdt, 2)
    sums = [torch.zeros(p.numel(), dtype=sdt) for p in params]
    for step in range(1, 11):
        grads = fresh(pdt, 200 + step)
        ref = [(p.clone(), s.clone()) for p, s in zip(params, sums)]
        op.adagrad_step(params, grads, sums, None, 1e-2, 1e-10, 0.01)
        pscales = [rp.double().abs() + 0.1 for rp, _ in ref]
        ref = [tuple(t.to(d) for t, d in zip(adagrad_ref(rp, g, rs, lr=1e-2, eps=1e-10, wd=0.01), (pdt, sdt)))
               for (rp, rs), g in zip(ref, grads)]
        for i, (p, s) in enumerate(zip(params, sums)):
            check(p, ref[i][0], pdt, f"step {step} param {i}", pscales[i])
            check(s, ref[i][1], sdt, f"step {step} sum {i}")


@pytest.mark.parametrize("simd", SIMD_PATHS)
@pytest.mark.parametrize("pdt,sdt", PAIRS, ids=lambda d: str(d).removeprefix("torch."))
def test_lion(simd, pdt, sdt):
    op = CPULionBuilder(simd=simd).load()
    params = fresh(pdt, 3)
    ms = [torch.zeros(p.numel(), dtype=sdt) for p in params]
    for step in range(1, 11):
        grads = fresh(pdt, 300 + step)
        ref = [(p.clone(), m.clone()) for p, m in zip(params, ms)]
        op.lion_step(params, grads, ms, None, 1e-3, 0.9, 0.99, 0.1)
        scales = [rm.double().abs() + g.double().abs() for (_, rm), g in zip(ref, grads)]
        # where beta1 * m + (1 - beta1) * g is within fp32 rounding of 0 its sign is a coin toss
        # for any fp32 implementation: allow the other sign's update (2 * lr) there
        ambiguous = [((0.9 * rm.double() + 0.1 * g.double()).abs() <= 4 * 2.0 ** -24 * s).double()
                     for (_, rm), g, s in zip(ref, grads, scales)]
        pscales = [rp.double().abs() + 0.01 + a * 2e-3 / (4 * 2.0 ** -24) for (rp, _), a in zip(ref, ambiguous)]
        ref = [tuple(t.to(d) for t, d in zip(lion_ref(rp, g, rm, lr=1e-3, beta1=0.9, beta2=0.99, wd=0.1), (pdt, sdt)))
               for (rp, rm), g in zip(ref, grads)]
        for i, (p, m) in enumerate(zip(params, ms)):
            check(p, ref[i][0], pdt, f"step {step} param {i}", pscales[i])
            check(m, ref[i][1], sdt, f"step {step} exp_avg {i}", scales[i])


@pytest.mark.parametrize("simd", SIMD_PATHS)
@pytest.mark.parametrize("gdt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("state_dt", [torch.float32, torch.bfloat16], ids=["fp32-states", "bf16-states"])
def test_fused_step_and_low_precision_copy(simd, gdt, state_dt):
    """ZeRO-Offload hot path: fp32 master, bf16/fp16 grads read directly, the bf16/fp16 copy
    written in the same pass."""
    master = fresh(torch.float32, 4)
    ms = [torch.zeros(p.numel(), dtype=state_dt) for p in master]
    vs = [torch.zeros(p.numel(), dtype=state_dt) for p in master]
    copies = [torch.full((p.numel(),), float("nan"), dtype=gdt) for p in master]  # poisoned
    for step in range(1, 11):
        grads = fresh(gdt, 400 + step)
        ref = [(p.clone(), m.clone(), v.clone()) for p, m, v in zip(master, ms, vs)]
        cpu_adam_step(master, grads, ms, vs, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=step,
                      copies=copies, simd=simd)
        new_ref = []
        for (rp, rm, rv), g in zip(ref, grads):
            p64, m64, v64 = adam_ref(rp, g, rm, rv, wd=0.01, step=step, adamw=True, **HP)
            new_ref.append((p64.float(), m64.to(state_dt), v64.to(state_dt)))
        scales = [rm.double().abs() + g.double().abs() for (_, rm, _), g in zip(ref, grads)]
        ref = new_ref
        for i, (p, c) in enumerate(zip(master, copies)):
            assert_rel(p, ref[i][0], 1e-6, f"step {step} master {i}")
            assert torch.equal(c, p.to(gdt)), f"copy {i} is not the master rounded to {gdt}"
            check(ms[i], ref[i][1], state_dt, f"exp_avg {i}", scales[i])
            check(vs[i], ref[i][2], state_dt, f"exp_avg_sq {i}")


def torch_pair(cls_ours, kwargs_ours, cls_torch, kwargs_torch, steps=10, groups=False):
    torch.manual_seed(0)
    base = [torch.randn(n, dtype=torch.float64) for n in (7, 1025, 33)]
    ours = [p.float().clone().requires_grad_() for p in base]
    ref = [p.clone().requires_grad_() for p in base]
    if groups:  # per-group hyperparameters
        ours = [{"params": ours[:2]}, {"params": ours[2:], "lr": 3e-3, "weight_decay": 0.0}]
        ref = [{"params": ref[:2]}, {"params": ref[2:], "lr": 3e-3, "weight_decay": 0.0}]
    o1, o2 = cls_ours(ours, **kwargs_ours), cls_torch(ref, **kwargs_torch)
    flat1 = [p for g in o1.param_groups for p in g["params"]]
    flat2 = [p for g in o2.param_groups for p in g["params"]]
    for _ in range(steps):
        gs = [torch.randn_like(p) for p in flat2]
        for a, b, g in zip(flat1, flat2, gs):
            a.grad, b.grad = g.float(), g
        o1.step()
        o2.step()
    return o1, o2, flat1, flat2


@pytest.mark.parametrize("groups", [False, True])
@pytest.mark.parametrize("case", ["adamw", "adam", "adagrad"])
def test_front_ends_match_torch_optim(case, groups):
    if case == "adamw":
        pair = (DeepSpeedCPUAdam, dict(lr=1e-2, weight_decay=0.05), torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05))
    elif case == "adam":
        pair = (DeepSpeedCPUAdam, dict(lr=1e-2, weight_decay=0.05, adamw_mode=False), torch.optim.Adam,
                dict(lr=1e-2, weight_decay=0.05))
    else:
        pair = (DeepSpeedCPUAdagrad, dict(lr=1e-2, weight_decay=0.05), torch.optim.Adagrad,
                dict(lr=1e-2, weight_decay=0.05, eps=1e-10))
    _, _, a, b = torch_pair(*pair, groups=groups)
    for i, (x, y) in enumerate(zip(a, b)):
        assert_rel(x, y, 1e-6, f"{case} param {i}")


def test_state_dict_round_trips_with_torch_adamw():
    o1, o2, a, b = torch_pair(DeepSpeedCPUAdam, dict(lr=1e-2), torch.optim.AdamW, dict(lr=1e-2), steps=3)
    sd = o2.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    # torch's AdamW state (float64 params) loads into ours (float32 params) and continues identically
    fresh_params = [p.detach().float().clone().requires_grad_() for p in b]
    ours = DeepSpeedCPUAdam(fresh_params, lr=1e-2)
    ours.load_state_dict(sd)
    back = torch.optim.AdamW([p.detach().clone().requires_grad_() for p in b], lr=1e-2)
    back.load_state_dict(ours.state_dict())  # and ours loads back into torch
    for _ in range(3):
        gs = [torch.randn_like(p) for p in b]
        for p, q, g in zip(fresh_params, back.param_groups[0]["params"], gs):
            p.grad, q.grad = g.float(), g
        ours.step()
        back.step()
    for x, y in zip(fresh_params, back.param_groups[0]["params"]):
        assert_rel(x, y, 1e-6, "after reload")
    assert int(ours.state[fresh_params[0]]["step"].item()) == 6


def test_lion_front_end_and_construction_from_param_groups():
    torch.manual_seed(1)
    params = [torch.randn(100, requires_grad=True)]
    donor = torch.optim.SGD(params, lr=0.5)
    opt = DeepSpeedCPULion(donor.param_groups, lr=1e-3, weight_decay=0.1)  # accelerate's pattern
    ref_p, ref_m = params[0].detach().clone(), torch.zeros(100)
    for _ in range(5):
        g = torch.randn(100)
        params[0].grad = g
        opt.step()
        # the donor group's own keys win, as in torch: SGD's lr 0.5 and weight_decay 0
        ref_p, ref_m = lion_ref(ref_p, g, ref_m, lr=0.5, beta1=0.9, beta2=0.999, wd=0.0)
    assert_rel(params[0].detach(), ref_p, 1e-6, "lion")


def test_fp16_param_groups_receive_the_updated_params():
    params = [torch.randn(37, requires_grad=True), torch.randn(1030, requires_grad=True)]
    copies = [[torch.empty(37, dtype=torch.bfloat16), torch.empty(1030, dtype=torch.bfloat16)]]
    opt = DeepSpeedCPUAdam(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step(fp16_param_groups=copies)
    for p, c in zip(params, copies[0]):
        assert torch.equal(c, p.detach().to(torch.bfloat16))


def test_amsgrad_and_bad_input_raise_clearly():
    p = torch.randn(4, requires_grad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        DeepSpeedCPUAdam([p], amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        DeepSpeedCPUAdagrad([p], amsgrad=True)
    meta = torch.nn.Parameter(torch.empty(4, device="meta"))
    meta.grad = torch.empty(4, device="meta")
    with pytest.raises(ValueError, match=r"params\[0\]\[0\] is on meta"):
        DeepSpeedCPUAdam([meta]).step()
    nc = torch.randn(4, 4).t().requires_grad_()
    nc.grad = torch.randn(4, 4)
    with pytest.raises(ValueError, match="not contiguous"):
        DeepSpeedCPUAdam([nc]).step()
    op = CPUAdamBuilder().load()
    a, b = [torch.zeros(5)], [torch.zeros(5)]
    args = (1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 1, 1)
    with pytest.raises(ValueError, match="'params' and 'grads' must have the same length, got 1 and 2"):
        op.adam_step(a, [torch.zeros(5), torch.zeros(5)], b, [torch.zeros(5)], None, *args)
    with pytest.raises(ValueError, match=r"'grads\[0\]' has 4 elements but 'params\[0\]' has 5"):
        op.adam_step(a, [torch.zeros(4)], b, [torch.zeros(5)], None, *args)
    with pytest.raises(TypeError, match=r"'params\[0\]' must be float32 or float16 or bfloat16, got float64"):
        op.adam_step([torch.zeros(5, dtype=torch.float64)], [torch.zeros(5)], b, [torch.zeros(5)], None, *args)
    with pytest.raises(ValueError, match=r"'exp_avgs\[0\]' must be contiguous"):
        op.adam_step(a, [torch.zeros(5)], [torch.zeros(10)[::2]], [torch.zeros(5)], None, *args)
    with pytest.raises(TypeError, match=r"'exp_avgs\[0\]' is float16 but its parameter is float32"):
        op.adam_step(a, [torch.zeros(5)], [torch.zeros(5, dtype=torch.float16)], [torch.zeros(5)], None, *args)
    with pytest.raises(ValueError, match="overlaps"):
        op.adam_step(a, a, b, [torch.zeros(5)], None, *args)
    with pytest.raises(ValueError, match="'step' must be >= 1"):
        op.adam_step(a, [torch.zeros(5)], b, [torch.zeros(5)], None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0, 1, 1)
    with pytest.raises(TypeError, match="'lr' must be a float"):
        op.adam_step(a, [torch.zeros(5)], b, [torch.zeros(5)], None, "x", 0.9, 0.999, 1e-8, 0.0, 1, 1, 1)
    with pytest.raises(TypeError, match="adam_step\\(\\) takes exactly 13 arguments"):
        op.adam_step(a)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to pass a CUDA tensor")
def test_cuda_tensors_rejected():
    op = CPUAdamBuilder().load()
    x = torch.zeros(5, device="cuda")
    with pytest.raises(ValueError, match=r"'params\[0\]' must be on the cpu device"):
        op.adam_step([x], [torch.zeros(5)], [torch.zeros(5)], [torch.zeros(5)], None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 1, 1)
