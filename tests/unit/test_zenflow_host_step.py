"""ZenFlow's host step with the clip coefficient and the interval mean folded into the C CPU Adam (grad_scale):
- the kernel's grad_scale gives the bits of scaling a copy first (fp32 multiply), on every SIMD path, for
  fp32/bf16/fp16 gradients, Adam and AdamW, in place and out of place; the gradient is left as it was; a
  kernel without grad_scale (Lion) gets a scaled copy from step_tensors; a non-finite grad_scale raises;
- ZenFlowStep (world 1, CPU, sync and overlap_step) against a float64 reference of DeepSpeed's ZenFlow
  update: the selected columns stepped every step with g * coef, the host's AdamW every update_interval
  steps with the mean of the clipped gradients over ALL elements (DeepSpeed's host step updates the
  selected columns' master and moments too; the model then takes the device's values for them)."""
from __future__ import annotations

import math

import pytest
import torch

import deepspeed_c.runtime.config  # noqa: F401  (before zenflow_config, which the config package imports)
from deepspeed_c.ops.adam.cpu_adam import DeepSpeedCPUAdam
from deepspeed_c.ops.lion.cpu_lion import DeepSpeedCPULion
from deepspeed_c.ops.op_builder import CPUAdamBuilder, toolchain
from deepspeed_c.ops.op_builder.builder import SIMD_LEVELS
from deepspeed_c.ops.partition import PartitionPlan
from deepspeed_c.runtime.zenflow.zenflow_config import ZenFlowSchedule
from deepspeed_c.runtime.zenflow.zenflow_step import ZenFlowStep
from tests.unit.cpu_optim_reference import adam_ref, lion_ref

RUNNABLE = [s for s in SIMD_LEVELS if not toolchain.missing_isa(s)]
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.01)
COEF = 0.3712345678  # a clip coefficient that is not a float32


@pytest.mark.parametrize("simd", RUNNABLE)
def test_grad_scale_equals_scaling_a_copy_first(simd):
    op = CPUAdamBuilder(simd=simd).load()
    gen = torch.Generator().manual_seed(1)
    n = 3 * 4096 + 37  # several chunks and a SIMD tail
    for gdt in (torch.float32, torch.bfloat16, torch.float16):
        for adamw in (0, 1):
            p, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1
            v, g = torch.rand(n, generator=gen) * 0.01, torch.randn(n, generator=gen).to(gdt)
            g_before = g.clone()
            hp = (1e-3, 0.9, 0.999, 1e-8, 0.01, 3, 1, adamw)
            old = [t.clone() for t in (p, m, v)] + [torch.empty(n, dtype=torch.bfloat16)]
            new = [t.clone() for t in (p, m, v)] + [torch.empty(n, dtype=torch.bfloat16)]
            op.adam_step([old[0]], [g.float().mul(COEF)], [old[1]], [old[2]], [old[3]], *hp)
            op.adam_step([new[0]], [g], [new[1]], [new[2]], [new[3]], *hp, COEF)
            for a, b, what in zip(old, new, ("param", "exp_avg", "exp_avg_sq", "copy")):
                assert torch.equal(a, b), (simd, gdt, adamw, what)
            assert torch.equal(g, g_before), "the kernel must not scale the gradient in place"
            outs = [torch.empty(n) for _ in range(3)]  # out of place (SuperOffload's speculative step)
            op.adam_step_into([p], [g], [m], [v], None, [outs[0]], [outs[1]], [outs[2]], *hp, COEF)
            for a, b in zip(old[:3], outs):
                assert torch.equal(a, b), (simd, gdt, adamw, "into")


def test_grad_scale_against_float64_and_bad_input():
    gen = torch.Generator().manual_seed(2)
    n = 1000
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    opt = DeepSpeedCPUAdam([torch.nn.Parameter(p.clone())], lr=HP["lr"], weight_decay=HP["wd"])
    group = opt.param_groups[0]
    got = p.clone()
    opt.step_tensors(group, [got], [g], [[m], [v]], None, 1, grad_scale=COEF)
    want, _, _ = adam_ref(p, g.double() * COEF, torch.zeros(n), torch.zeros(n), lr=HP["lr"], beta1=0.9,
                          beta2=0.999, eps=1e-8, wd=HP["wd"], step=1, adamw=True)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)
    # Lion's kernel takes no grad_scale: step_tensors scales a copy, the gradient untouched
    lion = DeepSpeedCPULion([torch.nn.Parameter(p.clone())], lr=1e-3, weight_decay=0.1)
    got, m, g_before = p.clone(), torch.zeros(n), g.clone()
    lion.step_tensors(lion.param_groups[0], [got], [g], [[m]], None, 1, grad_scale=COEF)
    want, _ = lion_ref(p, g.double() * COEF, torch.zeros(n), lr=1e-3, beta1=0.9, beta2=0.99, wd=0.1)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)
    assert torch.equal(g, g_before)
    op = CPUAdamBuilder().load()
    with pytest.raises(ValueError, match="'grad_scale' must be finite"):
        op.adam_step([p], [g], [m], [torch.zeros(n)], None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 1, 1, math.nan)
    with pytest.raises(TypeError, match="'grad_scale' must be a float"):
        op.adam_step([p], [g], [m], [torch.zeros(n)], None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 1, 1, "x")


# -- ZenFlowStep's host step against float64 --------------------------------------------------------------
SHAPES = [(8, 12), (5,), (6, 10)]  # two matrices and a vector (a vector is stepped wholly on the device)
TOPK, INTERVAL, STEPS = 0.25, 3, 6
COEFS = [0.3, 1.0, 0.7, 0.55, 0.9, 0.25]


class _Writer:
    def submit(self, g, b, t):
        pass

    def finish(self):
        pass


def _zenflow(overlap: bool) -> tuple[ZenFlowStep, torch.Tensor, DeepSpeedCPUAdam]:
    numels = [math.prod(s) for s in SHAPES]
    plan = PartitionPlan.build(numels, 1, 10**6, 1, list(range(len(SHAPES))))
    master = torch.nn.Parameter(torch.randn(plan.partition_size("runtime"),
                                            generator=torch.Generator().manual_seed(3)))
    opt = DeepSpeedCPUAdam([master], lr=HP["lr"], weight_decay=HP["wd"])
    sched = ZenFlowSchedule(topk_ratio=TOPK, select_interval=0, update_interval=INTERVAL, auto_update=False,
                            auto_ratio=0.99, full_warm_up_rounds=0, overlap_step=overlap, offload=False,
                            pt_reserved_cores_perc=0.5)
    z = ZenFlowStep(opt, [master], [plan], [[torch.Size(s) for s in SHAPES]], _Writer(), sched, rank=0,
                    world_size=1, group=None, device=torch.device("cpu"), lp_dtype=torch.float32, pin_memory=False)
    return z, master, opt


def _expected_positions(g0: torch.Tensor, z: ZenFlowStep) -> torch.Tensor:
    """Top int(TOPK * cols) columns of each matrix by sum |g| of the first step; vectors whole."""
    out = []
    for i, (param, param_off, part_start, length) in enumerate(z.views[0].slices):
        shape = SHAPES[param]
        block = g0[part_start:part_start + length].double()
        if len(shape) == 1:
            out.append(torch.arange(part_start, part_start + length))
            continue
        rows, cols = shape
        cols_top = torch.topk(block.view(rows, cols).abs().sum(0), int(TOPK * cols)).indices
        sel = (torch.arange(rows)[:, None] * cols + torch.sort(cols_top).values[None, :]).reshape(-1)
        out.append(sel + part_start)
    return torch.sort(torch.cat(out)).values


@pytest.mark.parametrize("overlap", [False, True])
def test_host_step_equals_float64_zenflow(overlap):
    z, master, opt = _zenflow(overlap)
    n = master.numel()
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(n, generator=gen) for _ in range(STEPS)]
    w0 = master.detach().clone().double()
    try:
        for t in range(STEPS):
            z.apply([grads[t].clone()], COEFS[t])
        # the counters benchmarks/offload.py's steady-state timing asserts on: every boundary hands one host
        # step to the background and takes the previous one's result; the last is taken by settle
        hosts = STEPS // INTERVAL
        assert (z.stats["handoffs"], z.stats["joins"]) == ((hosts, hosts - 1) if overlap else (0, 0))
        z.settle(apply=True)  # with overlap_step the last host step is still running: finished and applied
        assert (z.stats["handoffs"], z.stats["joins"]) == ((hosts, hosts) if overlap else (0, 0))
        assert z.stats["host_steps"] == len(z.host_log) == hosts and not z.blocked.is_set()
        model = z.dev_lp[0].double()
        pos = torch.sort(z.positions[0]).values
        assert torch.equal(pos, _expected_positions(grads[0], z))
        kw = dict(lr=HP["lr"], beta1=HP["beta1"], beta2=HP["beta2"], eps=HP["eps"], wd=HP["wd"], adamw=True)
        # the device: the selected elements every step, with the clipped gradient, moments from zero
        zeros = torch.zeros(pos.numel(), dtype=torch.float64)
        sp, sm, sv = w0[pos], zeros, zeros
        for t in range(STEPS):
            sp, sm, sv = adam_ref(sp, grads[t].double()[pos] * COEFS[t], sm, sv, step=t + 1, **kw)
        # the host: every element, once per interval, with the mean clipped gradient (DeepSpeed's host step)
        hp, hm, hv = w0, torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
        for k in range(STEPS // INTERVAL):
            window = range(k * INTERVAL, (k + 1) * INTERVAL)
            mean = sum(grads[t].double() * COEFS[t] for t in window) / INTERVAL
            hp, hm, hv = adam_ref(hp, mean, hm, hv, step=k + 1, **kw)
        want = hp.clone()
        want[pos] = sp
        torch.testing.assert_close(model, want, rtol=1e-5, atol=1e-6)
        st = opt.state[master]
        torch.testing.assert_close(st["exp_avg"].double(), hm, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(st["exp_avg_sq"].double(), hv, rtol=1e-5, atol=1e-9)
        assert int(st["step"].item()) == STEPS // INTERVAL
        # settle wrote the device's selected values into the master: it holds the model
        torch.testing.assert_close(master.detach().double(), want, rtol=1e-5, atol=1e-6)
        for accs in z.acc_sets:  # every interval's accumulator stepped and zeroed
            assert all(float(a.abs().sum()) == 0.0 for a in accs)
        assert len(z.acc_sets) == (2 if overlap else 1)
    finally:
        z.close()
