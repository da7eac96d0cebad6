"""The C CPU optimizers against float64 references: every optimizer, every supported (param, state)
dtype pair, every SIMD path this CPU runs, lengths with vector tails, 10 steps.

Each step's reference starts from the kernel's own tensors before that step (float64 math, then
rounding to each operand's storage dtype), so a one-ulp rounding difference in one step cannot
snowball into later ones (an independent 16-bit trajectory cannot stay within one ulp: where
beta * m + (1 - beta) * g nearly cancels, a one-ulp difference in a state is a large relative
one, and it moves later parameters by more than an ulp). test_cpu_optim_front_ends.py checks 10
uninterrupted steps against torch.optim in fp32."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.ops.adam.cpu_adam import cpu_adam_step
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



# (param, grad, states, copy) combinations outside the specialised loops: the generic loop,
# several in one call, so the per-tensor dispatch is exercised too
MIXED = [(torch.bfloat16, torch.float32, torch.bfloat16, None), (torch.float16, torch.bfloat16, torch.float32, torch.bfloat16),
         (torch.float32, torch.float16, torch.bfloat16, torch.float16), (torch.bfloat16, torch.float16, torch.float32, torch.float16),
         (torch.float16, torch.float32, torch.float16, torch.float32), (torch.float32, torch.float32, torch.float32, torch.float32)]


@pytest.mark.parametrize("simd", SIMD_PATHS)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam-l2"])
def test_adam_mixed_dtype_list(simd, adamw):
    op = CPUAdamBuilder(simd=simd).load()
    g0 = torch.Generator().manual_seed(5)
    sizes = [int(n) for n in torch.randint(1, 3000, (len(MIXED),), generator=g0)]
    params = [torch.randn(n, generator=g0).to(pd) for n, (pd, _, _, _) in zip(sizes, MIXED)]
    ms = [torch.zeros(n, dtype=sd) for n, (_, _, sd, _) in zip(sizes, MIXED)]
    vs = [torch.zeros(n, dtype=sd) for n, (_, _, sd, _) in zip(sizes, MIXED)]
    # one copy list for the call (all or none); where MIXED says None the copy is float32
    copies = [torch.empty(n, dtype=cd or torch.float32) for n, (_, _, _, cd) in zip(sizes, MIXED)]
    for step in range(1, 11):
        grads = [torch.randn(n, generator=g0).to(gd) for n, (_, gd, _, _) in zip(sizes, MIXED)]
        ref = [(p.clone(), m.clone(), v.clone()) for p, m, v in zip(params, ms, vs)]
        op.adam_step(params, grads, ms, vs, copies, HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], 0.1, step, 1,
                     int(adamw))
        for i, ((rp, rm, rv), g, (pd, _, sd, _)) in enumerate(zip(ref, grads, MIXED)):
            p64, m64, v64 = adam_ref(rp, g, rm, rv, wd=0.1, step=step, adamw=adamw, **HP)
            scale = rm.double().abs() + g.double().abs() + rp.double().abs()
            check(params[i], p64.to(pd), pd, f"step {step} param {i}", rp.double().abs() + 10 * HP["lr"])
            check(ms[i], m64.to(sd), sd, f"step {step} exp_avg {i}", scale)
            check(vs[i], v64.to(sd), sd, f"step {step} exp_avg_sq {i}")
            # the copy is the stored parameter converted (not a differently rounded fp32 value)
            assert torch.equal(copies[i], params[i].to(copies[i].dtype)), f"copy {i}"


@pytest.mark.parametrize("simd", SIMD_PATHS)
@pytest.mark.parametrize("cdt", [torch.bfloat16, torch.float16])
def test_adagrad_and_lion_write_the_copy(simd, cdt):
    """fp32 master, 16-bit grads and copy: the offload layout for Adagrad and Lion."""
    g0 = torch.Generator().manual_seed(6)
    master = [torch.randn(n, generator=g0) for n in (5, 1031)]
    grads = [torch.randn(p.numel(), generator=g0).to(cdt) for p in master]
    sums, ms = [torch.rand(p.numel(), generator=g0) for p in master], [torch.randn(p.numel(), generator=g0) for p in master]
    copies = [torch.full((p.numel(),), float("nan"), dtype=cdt) for p in master]
    ref = [adagrad_ref(p, g, s, lr=1e-2, eps=1e-10, wd=0.01) for p, g, s in zip(master, grads, sums)]
    CPUAdagradBuilder(simd=simd).load().adagrad_step(master, grads, sums, copies, 1e-2, 1e-10, 0.01)
    for p, c, (p64, s64), s in zip(master, copies, ref, sums):
        assert_rel(p, p64, 1e-6, "adagrad master")
        assert_rel(s, s64, 1e-6, "adagrad sum")
        assert torch.equal(c, p.to(cdt))
    ref = [lion_ref(p, g, m, lr=1e-3, beta1=0.9, beta2=0.99, wd=0.1) for p, g, m in zip(master, grads, ms)]
    CPULionBuilder(simd=simd).load().lion_step(master, grads, ms, copies, 1e-3, 0.9, 0.99, 0.1)
    for p, c, (p64, m64), m in zip(master, copies, ref, ms):
        assert_rel(p, p64, 1e-6, "lion master")
        assert_rel(m, m64, 1e-6, "lion exp_avg")
        assert torch.equal(c, p.to(cdt))
