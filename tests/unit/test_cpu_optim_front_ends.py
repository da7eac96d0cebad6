"""DeepSpeedCPUAdam / DeepSpeedCPUAdagrad / DeepSpeedCPULion as torch.optim.Optimizers: 10
uninterrupted steps against torch.optim (float64 parameters) and written-out float64 references,
param groups, state dicts that load in both directions, construction from another optimizer's
param_groups, DeepSpeed's fp16_param_groups, low-precision parameters, and clear errors."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed_c.ops.adam import DeepSpeedCPUAdam
from deepspeed_c.ops.lion import DeepSpeedCPULion
from deepspeed_c.ops.op_builder import CPUAdamBuilder
from tests.unit.cpu_optim_reference import assert_rel, lion_ref

SHAPES = ((7,), (41, 25), (3, 5, 11), (1,))  # 1025 elements in (41, 25): a tail after the vectors


def torch_pair(cls_ours, kwargs_ours, cls_torch, kwargs_torch, steps=10, groups=False):
    torch.manual_seed(0)
    base = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
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


CASES = {
    "adamw": (DeepSpeedCPUAdam, dict(lr=1e-2, weight_decay=0.05), torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05)),
    "adam-l2": (DeepSpeedCPUAdam, dict(lr=1e-2, weight_decay=0.05, adamw_mode=False), torch.optim.Adam,
                dict(lr=1e-2, weight_decay=0.05)),
    "adagrad": (DeepSpeedCPUAdagrad, dict(lr=1e-2, weight_decay=0.05), torch.optim.Adagrad,
                dict(lr=1e-2, weight_decay=0.05, eps=1e-10)),
}


@pytest.mark.parametrize("groups", [False, True], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("case", list(CASES))
def test_front_ends_match_torch_optim(case, groups):
    _, _, a, b = torch_pair(*CASES[case], groups=groups)
    for i, (x, y) in enumerate(zip(a, b)):
        assert_rel(x, y, 1e-6, f"{case} param {i}")


def adam_no_bias_correction_reference(params, lr, beta1=0.9, beta2=0.999, eps=1e-8):
    """torch has no bias_correction switch: a float64 AdamW without it, written out."""
    state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]

    def step():
        for p, (m, v) in zip(params, state):
            m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            p.data.sub_(lr * m / (v.sqrt() + eps))
    return step


def test_adam_without_bias_correction():
    class Ref:  # duck-typed torch.optim for torch_pair
        def __init__(self, params, lr):
            self.param_groups = [{"params": list(params)}]
            self.step = adam_no_bias_correction_reference(self.param_groups[0]["params"], lr)

    _, _, a, b = torch_pair(DeepSpeedCPUAdam, dict(lr=1e-3, bias_correction=False), Ref, dict(lr=1e-3))
    for i, (x, y) in enumerate(zip(a, b)):
        assert_rel(x, y, 1e-6, f"param {i}")


def test_adam_state_dict_round_trips_with_torch_adamw():
    _, o2, _, b = torch_pair(DeepSpeedCPUAdam, dict(lr=1e-2), torch.optim.AdamW, dict(lr=1e-2), steps=3)
    sd = o2.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    # torch's AdamW state (float64 params) loads into ours (float32 params) and continues identically
    fresh_params = [p.detach().float().clone().requires_grad_() for p in b]
    ours = DeepSpeedCPUAdam(fresh_params, lr=1e-2)
    ours.load_state_dict(sd)
    back = torch.optim.AdamW([p.detach().clone().requires_grad_() for p in b], lr=1e-2)
    back.load_state_dict(ours.state_dict())  # and ours loads back into torch
    for _ in range(3):  # both step, each counting its own steps
        gs = [torch.randn_like(p) for p in b]
        for p, q, g in zip(fresh_params, back.param_groups[0]["params"], gs):
            p.grad, q.grad = g.float(), g
        ours.step()
        back.step()
    for x, y in zip(fresh_params, back.param_groups[0]["params"]):
        assert_rel(x, y, 1e-6, "after reload")
    assert int(ours.state[fresh_params[0]]["step"].item()) == 6


def test_adagrad_state_dict_round_trips_with_torch_adagrad():
    _, o2, _, b = torch_pair(DeepSpeedCPUAdagrad, dict(lr=1e-2), torch.optim.Adagrad, dict(lr=1e-2, eps=1e-10),
                             steps=3)
    sd = o2.state_dict()
    assert set(sd["state"][0]) == {"step", "sum"}
    fresh_params = [p.detach().float().clone().requires_grad_() for p in b]
    ours = DeepSpeedCPUAdagrad(fresh_params, lr=1e-2)
    ours.load_state_dict(sd)
    back = torch.optim.Adagrad([p.detach().clone().requires_grad_() for p in b], lr=1e-2, eps=1e-10)
    back.load_state_dict(ours.state_dict())
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
    assert_rel(opt.state[params[0]]["exp_avg"], ref_m, 1e-6, "lion exp_avg")


def test_lion_groups_match_reference_for_10_steps():
    torch.manual_seed(2)
    ps = [torch.randn(s, requires_grad=True) for s in SHAPES]
    opt = DeepSpeedCPULion([{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-4, "betas": (0.95, 0.98)}], lr=1e-3,
                           weight_decay=0.1)
    ref = [(p.detach().double().clone(), torch.zeros_like(p, dtype=torch.float64)) for p in ps]
    hps = [dict(lr=1e-3, beta1=0.9, beta2=0.999)] * 2 + [dict(lr=3e-4, beta1=0.95, beta2=0.98)] * 2
    for _ in range(10):
        gs = [torch.randn_like(p) for p in ps]
        for p, g in zip(ps, gs):
            p.grad = g
        opt.step()
        ref = [lion_ref(rp, g, rm, wd=0.1, **hp) for (rp, rm), g, hp in zip(ref, gs, hps)]
    for i, (p, (rp, _)) in enumerate(zip(ps, ref)):
        assert_rel(p.detach(), rp, 1e-6, f"lion param {i}")


@pytest.mark.parametrize("pdt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp32_states", [True, False])
def test_low_precision_params_step_like_the_kernel(pdt, fp32_states):
    """A bf16/fp16 model stepped on the CPU: state dtype per fp32_optimizer_states, and the same
    bits as the kernel (checked against float64 in test_cpu_optimizers.py)."""
    torch.manual_seed(3)
    ps = [torch.randn(s).to(pdt).requires_grad_() for s in SHAPES]
    twins = [p.detach().clone().reshape(-1) for p in ps]
    sdt = torch.float32 if fp32_states else pdt
    ms, vs = [torch.zeros(t.numel(), dtype=sdt) for t in twins], [torch.zeros(t.numel(), dtype=sdt) for t in twins]
    opt = DeepSpeedCPUAdam(ps, lr=1e-2, weight_decay=0.01, fp32_optimizer_states=fp32_states)
    op = CPUAdamBuilder().load()
    for step in range(1, 4):
        gs = [torch.randn_like(p) for p in ps]
        for p, g in zip(ps, gs):
            p.grad = g
        opt.step()
        op.adam_step(twins, [g.reshape(-1) for g in gs], ms, vs, None, 1e-2, 0.9, 0.999, 1e-8, 0.01, step, 1, 1)
    for p, t, m in zip(ps, twins, ms):
        assert opt.state[p]["exp_avg"].dtype == sdt and opt.state[p]["exp_avg_sq"].dtype == sdt
        assert torch.equal(p.detach().reshape(-1), t)
        assert torch.equal(opt.state[p]["exp_avg"].reshape(-1), m)


def test_bf16_states_beside_fp32_params_are_kept():
    p = torch.randn(300, requires_grad=True)
    opt = DeepSpeedCPUAdam([p], lr=1e-2)
    opt.state[p]["step"] = torch.tensor(0.0)
    opt.state[p]["exp_avg"] = torch.zeros(300, dtype=torch.bfloat16)
    opt.state[p]["exp_avg_sq"] = torch.zeros(300, dtype=torch.bfloat16)
    twin = p.detach().clone()
    m, v = torch.zeros(300, dtype=torch.bfloat16), torch.zeros(300, dtype=torch.bfloat16)
    for step in (1, 2):
        p.grad = torch.randn(300)
        opt.step()
        CPUAdamBuilder().load().adam_step([twin], [p.grad], [m], [v], None, 1e-2, 0.9, 0.999, 1e-8, 0.0, step, 1, 1)
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(p.detach(), twin) and torch.equal(opt.state[p]["exp_avg_sq"], v)


def test_fp16_param_groups_receive_the_updated_params():
    params = [torch.randn(37, requires_grad=True), torch.randn(1030, requires_grad=True)]
    extra = torch.randn(9, requires_grad=True)
    # per group, matching the group's params; the second copy is a non-contiguous view, which
    # goes through a staging buffer (as a GPU copy would)
    backing = torch.zeros(1030, 2, dtype=torch.float16)
    copies = [[torch.empty(37, dtype=torch.bfloat16), backing[:, 0]], [torch.empty(9, dtype=torch.bfloat16)]]
    opt = DeepSpeedCPUAdam([{"params": params}, {"params": [extra], "lr": 1e-3}], lr=1e-2)
    for p in (*params, extra):
        p.grad = torch.randn_like(p)
    opt.step(fp16_param_groups=copies)
    for p, c in zip((*params, extra), (*copies[0], *copies[1])):
        assert torch.equal(c, p.detach().to(c.dtype))
    assert torch.equal(backing[:, 1], torch.zeros(1030, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"fp16_param_groups\[0\] has 1 tensors; param group 0 has 2"):
        opt.step(fp16_param_groups=[[copies[0][0]], copies[1]])


def test_closure_and_params_without_grad():
    a, b = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    opt = DeepSpeedCPUAdam([a, b], lr=1e-2)
    before = b.detach().clone()

    def closure():
        opt.zero_grad()
        loss = (a * a).sum()
        loss.backward()
        return loss
    loss = opt.step(closure)
    assert torch.is_tensor(loss) and a.grad is not None
    assert torch.equal(b.detach(), before) and b not in opt.state  # no grad: untouched, no state


def test_rejected_step_leaves_state_unchanged_and_reset_state_restarts():
    p = torch.randn(6, requires_grad=True)
    opt = DeepSpeedCPUAdam([p], lr=1e-2)
    p.grad = torch.randn(6)
    opt.step()
    before = p.detach().clone()
    opt.state[p]["exp_avg"] = torch.zeros(6, dtype=torch.float16)  # not a state dtype for fp32 params
    with pytest.raises(TypeError, match=r"'exp_avgs\[0\]' is float16 but its parameter is float32"):
        opt.step()
    assert int(opt.state[p]["step"].item()) == 1 and torch.equal(p.detach(), before)
    opt.state.clear()  # a user resetting the optimizer state
    p.grad = torch.randn(6)
    opt.step()
    assert int(opt.state[p]["step"].item()) == 1


def test_bump_steps_counts_in_place_and_validates_first():
    op = CPUAdamBuilder().load()
    steps = [torch.tensor(0.0), torch.tensor(41.0)]
    assert op.bump_steps(steps) == [1, 42] and steps[1].item() == 42.0
    with pytest.raises(ValueError, match=r"'steps\[1\]' must hold one element \(a step count\), got 2"):
        op.bump_steps([steps[0], torch.zeros(2)])
    assert steps[0].item() == 1.0  # nothing changed
    with pytest.raises(TypeError, match=r"'steps\[0\]' must be float32"):
        op.bump_steps([torch.tensor(1.0, dtype=torch.float64)])


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
    with pytest.raises(ValueError, match=r"params\[0\]\[0\] is not contiguous"):
        DeepSpeedCPUAdam([nc]).step()
    dbl = torch.randn(4, dtype=torch.float64, requires_grad=True)
    dbl.grad = torch.randn(4, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"params\[0\]\[0\] is torch.float64"):
        DeepSpeedCPULion([dbl]).step()
    op = CPUAdamBuilder().load()
    a, b = [torch.zeros(5)], [torch.zeros(5)]
    args = (1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 1, 1)
    with pytest.raises(ValueError, match="'params' and 'grads' must have the same length, got 1 and 2"):
        op.adam_step(a, [torch.zeros(5), torch.zeros(5)], b, [torch.zeros(5)], None, *args)
    with pytest.raises(ValueError, match=r"'grads\[0\]' has 4 elements but 'params\[0\]' has 5"):
        op.adam_step(a, [torch.zeros(4)], b, [torch.zeros(5)], None, *args)
    with pytest.raises(ValueError, match=r"'copies\[0\]' has 6 elements but 'params\[0\]' has 5"):
        op.adam_step(a, [torch.zeros(5)], b, [torch.zeros(5)], [torch.zeros(6, dtype=torch.bfloat16)], *args)
    with pytest.raises(TypeError, match=r"'params\[0\]' must be float32 or float16 or bfloat16, got float64"):
        op.adam_step([torch.zeros(5, dtype=torch.float64)], [torch.zeros(5)], b, [torch.zeros(5)], None, *args)
    with pytest.raises(TypeError, match=r"'grads\[0\]' must be float32 or float16 or bfloat16, got int32"):
        op.adam_step(a, [torch.zeros(5, dtype=torch.int32)], b, [torch.zeros(5)], None, *args)
    with pytest.raises(ValueError, match=r"'exp_avgs\[0\]' must be contiguous"):
        op.adam_step(a, [torch.zeros(5)], [torch.zeros(10)[::2]], [torch.zeros(5)], None, *args)
    with pytest.raises(TypeError, match=r"'exp_avgs\[0\]' is float16 but its parameter is float32"):
        op.adam_step(a, [torch.zeros(5)], [torch.zeros(5, dtype=torch.float16)], [torch.zeros(5)], None, *args)
    with pytest.raises(TypeError, match=r"'exp_avgs\[0\]' is float32 but 'exp_avg_sqs\[0\]' is bfloat16"):
        op.adam_step(a, [torch.zeros(5)], b, [torch.zeros(5, dtype=torch.bfloat16)], None, *args)
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
    with pytest.raises(ValueError, match=r"'grads\[0\]' must be on the cpu device"):
        op.adam_step([torch.zeros(5)], [x], [torch.zeros(5)], [torch.zeros(5)], None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 1, 1)
    p = torch.randn(5, device="cuda", requires_grad=True)
    p.grad = torch.randn(5, device="cuda")
    with pytest.raises(ValueError, match=r"params\[0\]\[0\] is on cuda"):
        DeepSpeedCPUAdam([p]).step()
