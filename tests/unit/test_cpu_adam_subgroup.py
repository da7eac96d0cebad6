"""DeepSpeedCPUAdam.step_subgroup / rollback_subgroup, DeepSpeed's SuperOffload API: the scenarios of
DeepSpeed's tests/unit/ops/adam/test_cpu_adam.py (state per sub-group, step counts, the errors), plus the
numbers: step_subgroup equals torch.optim.AdamW, and a rollback restores the parameter and moments."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.ops.adam import DeepSpeedCPUAdam


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_step_subgroup_basic(dtype):
    param = torch.nn.Parameter(torch.randn(64).to(dtype))
    opt = DeepSpeedCPUAdam([param])
    param.grad = torch.randn(64).to(dtype)
    before = param.data.clone()
    opt.step_subgroup(0)
    assert not torch.equal(param.data, before)
    assert opt.state[0]["step"] == 1 and "exp_avg" in opt.state[0] and "exp_avg_sq" in opt.state[0]
    for step in (2, 3):
        opt.step_subgroup(0)
        assert opt.state[0]["step"] == step


def test_step_subgroup_matches_torch_adamw():
    torch.manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(300, dtype=torch.float64))
    param = torch.nn.Parameter(ref.detach().float().clone())
    opt = DeepSpeedCPUAdam([param], lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    for _ in range(4):
        g = torch.randn(300, dtype=torch.float64)
        ref.grad, param.grad = g, g.float()
        ref_opt.step()
        opt.step_subgroup(7)
    torch.testing.assert_close(param.detach().double(), ref.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("adamw", [True, False])
def test_rollback_restores_state(adamw):
    torch.manual_seed(1)
    param = torch.nn.Parameter(torch.randn(500))
    opt = DeepSpeedCPUAdam([param], lr=1e-2, weight_decay=0.05, adamw_mode=adamw)
    for _ in range(3):
        param.grad = torch.randn(500)
        opt.step_subgroup(0)
    saved = [param.detach().clone(), opt.state[0]["exp_avg"].clone(), opt.state[0]["exp_avg_sq"].clone()]
    param.grad = torch.randn(500)
    opt.step_subgroup(0)
    assert opt.state[0]["step"] == 4
    opt.rollback_subgroup(0)
    assert opt.state[0]["step"] == 3
    for now, then in zip([param.detach(), opt.state[0]["exp_avg"], opt.state[0]["exp_avg_sq"]], saved):
        torch.testing.assert_close(now, then, rtol=1e-5, atol=1e-7)


def test_rollback_sequence_and_errors():
    param = torch.nn.Parameter(torch.randn(64))
    opt = DeepSpeedCPUAdam([param])
    with pytest.raises(RuntimeError, match="Cannot rollback optimizer state for sub_group_id 0"):
        opt.rollback_subgroup(0)
    param.grad = torch.randn(64)
    for step in range(1, 4):
        opt.step_subgroup(0)
        assert opt.state[0]["step"] == step
    for step in range(2, -1, -1):
        opt.rollback_subgroup(0)
        assert opt.state[0]["step"] == step
    with pytest.raises(RuntimeError, match="Cannot rollback sub_group_id 0: step count is 0"):
        opt.rollback_subgroup(0)


def test_multiple_subgroups_keep_their_own_state():
    param = torch.nn.Parameter(torch.randn(64))
    opt = DeepSpeedCPUAdam([param])
    param.grad = torch.randn(64)
    opt.step_subgroup(0)
    opt.step_subgroup(1)
    opt.step_subgroup(1)
    assert opt.state[0]["step"] == 1 and opt.state[1]["step"] == 2
    assert not torch.equal(opt.state[0]["exp_avg"], opt.state[1]["exp_avg"])


@pytest.mark.parametrize("simd", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_step_into_equals_in_place_and_leaves_inputs(simd, state_dtype):
    """adam_step_into (SuperOffload's out-of-place step) gives the in-place step's bits and touches no input;
    odd sizes exercise the SIMD tails; outputs at every misalignment (out_off) the streaming stores' aligned body
    and its peeled head."""
    from deepspeed_c.ops.op_builder import CPUAdamBuilder, toolchain

    if toolchain.missing_isa(simd):
        pytest.skip(f"this CPU cannot run {simd}")
    op = CPUAdamBuilder(simd=simd).load()
    torch.manual_seed(2)
    n = 1000 + 13
    p, g = torch.randn(n), torch.randn(n).bfloat16()
    m, v = torch.randn(n).to(state_dtype), torch.rand(n).to(state_dtype)
    ins = [t.clone() for t in (p, m, v)]
    outs = [torch.empty_like(t) for t in (p, m, v)]
    for out_off in (1, 5, 15):  # fp32 outputs 4, 20, 60 bytes past a 64-byte boundary; the bits as aligned ones
        shifted = [torch.empty(n + out_off, dtype=t.dtype)[out_off:] for t in (p, m, v)]
        op.adam_step_into([ins[0]], [g], [ins[1]], [ins[2]], None, [shifted[0]], [shifted[1]], [shifted[2]],
                          1e-2, 0.9, 0.999, 1e-8, 0.01, 3, 1, 1)
        op.adam_step_into([ins[0]], [g], [ins[1]], [ins[2]], None, [outs[0]], [outs[1]], [outs[2]],
                          1e-2, 0.9, 0.999, 1e-8, 0.01, 3, 1, 1)
        assert all(torch.equal(a, b) for a, b in zip(shifted, outs))
    cp_into, cp_inplace = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    args = (1e-2, 0.9, 0.999, 1e-8, 0.01, 3, 1, 1)
    op.adam_step_into([ins[0]], [g], [ins[1]], [ins[2]], [cp_into], [outs[0]], [outs[1]], [outs[2]], *args)
    for a, b in zip(ins, (p, m, v)):
        assert torch.equal(a, b)
    op.adam_step([p], [g], [m], [v], [cp_inplace], *args)
    for a, b in zip(outs, (p, m, v)):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32))
    assert torch.equal(cp_into, cp_inplace)
