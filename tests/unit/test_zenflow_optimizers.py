"""deepspeed.ops.adam's ZenFlow optimizers against a float64 AdamW of the selected elements alone:
ZenFlowSelectiveAdamW (columns of the weight), ZenFlowSelectiveAdamW_stage3 (rows of a transposed partition
slice, grouped by group_id), offloaded moments, and ZenFlowCPUAdam's caller-numbered host step."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.ops.adam import ZenFlowCPUAdam, ZenFlowSelectiveAdamW, ZenFlowSelectiveAdamW_stage3

LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.999, 1e-8, 0.1


def _ref_adamw(p, grads, adam_w=True, first_step=1):
    """float64 Adam(W) of `p` over `grads`, moments from zero, step counts from first_step."""
    p, m, v = p.double().clone(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
    for i, g in enumerate(grads):
        t, g = first_step + i, g.double()
        if adam_w:
            p = p * (1 - LR * WD)
        else:
            g = g + WD * p
        m = B1 * m + (1 - B1) * g
        v = B2 * v + (1 - B2) * g * g
        p = p - LR / (1 - B1 ** t) * m / ((v / (1 - B2 ** t)).sqrt() + EPS)
    return p, m, v


@pytest.mark.parametrize("offload", [False, True])
def test_selective_adamw_steps_only_the_selected_columns(offload):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 5))
    b = torch.nn.Parameter(torch.randn(3))
    cols = torch.tensor([0, 3])
    start_w, start_b = w.detach().clone(), b.detach().clone()
    opt = ZenFlowSelectiveAdamW([w, b], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, offload=offload)
    if offload:  # the moments live in host memory on the parameters
        for p, shape in ((w, (3, 2)), (b, (3,))):
            p.exp_avg_cpu_data, p.exp_avg_sq_cpu_data = torch.zeros(shape), torch.zeros(shape)
    gw, gb = [torch.randn(3, 2) for _ in range(3)], [torch.randn(3) for _ in range(3)]
    for step in range(3):
        for p in (w, b):
            p.selected_indices = cols
        w.selected_grad, b.selected_grad = gw[step], gb[step]
        opt.temp_copy_param({0: [w, b]})
        w.data[:, cols] += 100.0  # overwritten meanwhile (the host step): the snapshot is written back
        opt.step()
        assert w.selected_grad is None and w.temp_selected_param is None
    want_w, m_w, _ = _ref_adamw(start_w[:, cols], gw)
    want_b, _, _ = _ref_adamw(start_b, gb)
    assert torch.allclose(w.data[:, cols].double(), want_w, atol=1e-5)
    assert torch.equal(w.data[:, [1, 2, 4]], start_w[:, [1, 2, 4]])  # unselected columns untouched
    assert torch.allclose(b.data.double(), want_b, atol=1e-5)
    assert opt.state[w]["step"].item() == 3
    moments = w.exp_avg_cpu_data if offload else opt.state[w]["exp_avg"]
    assert torch.allclose(moments.double(), m_w, atol=1e-6)
    opt.clear_selected_mv()
    assert moments.abs().sum() == 0


def test_selective_adamw_stage3_rows_of_partition_slices_by_group():
    torch.manual_seed(1)
    full = [torch.randn(4, 3), torch.randn(2, 6)]  # the weights as (columns, rows) of the partition's layout
    params, starts = [], []
    for gid, t in enumerate(full):
        p = torch.nn.Parameter(torch.zeros(1))
        p.ds_shape = tuple(t.shape)
        p.ds_tensor = torch.cat([torch.full((5,), 7.0), t.reshape(-1)])  # this rank's slice starts at 5
        p.complete_column_offset, p.complete_numel, p.group_id = 5, t.numel(), gid
        params.append(p)
        starts.append(t.clone())
    opt = ZenFlowSelectiveAdamW_stage3([{"params": [params[0]]}, {"params": [params[1]]}], lr=LR, betas=(B1, B2),
                                       eps=EPS, weight_decay=WD)
    rows = [torch.tensor([1, 3]), torch.tensor([0])]
    grads = [[torch.randn(len(r), t.shape[1]) for r, t in zip(rows, full)] for _ in range(2)]
    for step in range(2):
        for p, r, g in zip(params, rows, grads[step]):
            p.selected_indices, p.selected_grad = r, g
        opt.group_step(list(reversed(params)))  # grouped by group_id, whatever the order
        assert all(p.selected_grad is None for p in params)
    for p, r, t, gid in zip(params, rows, starts, range(2)):
        got = p.ds_tensor[5:].view(t.shape)
        want, _, _ = _ref_adamw(t[r], [grads[s][gid] for s in range(2)])
        assert torch.allclose(got[r].double(), want, atol=1e-5)
        keep = [i for i in range(t.shape[0]) if i not in r.tolist()]
        assert torch.equal(got[keep], t[keep]) and torch.equal(p.ds_tensor[:5], torch.full((5,), 7.0))
    params[0].selected_indices, params[0].selected_grad = rows[0], torch.randn(3, 3)
    with pytest.raises(ValueError, match="selected_grad has shape"):
        opt.group_step([params[0]])


def test_zenflow_cpu_adam_steps_at_the_callers_count():
    torch.manual_seed(2)
    p = torch.nn.Parameter(torch.randn(37))
    start = p.detach().clone()
    opt = ZenFlowCPUAdam([p], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, adamw_mode=False)
    assert opt.step == opt._sequential_step
    g = torch.randn(37)
    p.grad = g.clone()
    opt.step(4)  # the first host step, numbered 4 by ZenFlow: bias correction of step 4, moments from zero
    want, m, v = _ref_adamw(start, [g], adam_w=False, first_step=4)
    assert torch.allclose(p.detach().double(), want, atol=1e-5)
    assert opt.state[p]["step"].item() == 4 and torch.allclose(opt.state[p]["exp_avg"].double(), m, atol=1e-6)
    with pytest.raises(ValueError, match="step_id"):
        opt.step(0)
    plain = ZenFlowCPUAdam([torch.nn.Parameter(torch.zeros(2))], overlap_step=True)
    assert "step" not in vars(plain)  # the overlapped path keeps DeepSpeedCPUAdam's own step


def test_zenflow_auto_strategy_with_an_interval_parses_and_is_refused_at_resolve():
    from deepspeed_c.runtime.config.zenflow import resolve_schedule
    from deepspeed_c.runtime.zero.config import DeepSpeedZeroConfig

    cfg = DeepSpeedZeroConfig(zenflow={"select_strategy": "auto", "select_interval": 4})  # as DeepSpeed's model
    assert cfg.zenflow.select_interval == 4
    with pytest.raises(ValueError, match="select_interval would be overwritten"):
        resolve_schedule(cfg.zenflow)
