"""deepspeed_c.moe.layer.MoE on one process: outputs, l_aux, exp_counts and every gradient (gate,
experts, PR-MoE coefficient, input) against the dense torch formulation in float64 (einsum dispatch
and combine over one-hot [tokens, experts, capacity] tensors, the routing decided by the float64
references of tests/unit/moe_reference.py); the public helpers and the bad-input errors."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from deepspeed_c.moe.layer import MoE
from deepspeed_c.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from tests.unit.moe_reference import ref_top1, ref_top2, ref_topk

H = 12


def expert_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(H, 20), nn.GELU(), nn.Linear(20, H))


def reference_forward(moe: MoE, x: torch.Tensor, k: int, cf: float, min_cap: int, drop: bool, uniform=None):
    """(output, l_aux) of the dense float64 formulation, differentiable in the float64 copies it
    returns: (wg, experts, residual mlp, coefficient, x)."""
    wg = moe.deepspeed_moe.gate.wg.weight.detach().double().requires_grad_(True)
    experts = [copy.deepcopy(e).double() for e in moe.deepspeed_moe.experts.deepspeed_experts]
    xs = x.detach().double().reshape(-1, H).requires_grad_(True)
    logits = xs @ wg.t()
    S, E = logits.shape
    if k == 1:
        _, cw_ref, counts = ref_top1(logits.detach(), cf, min_cap, drop=drop, uniform=uniform)
    elif k == 2:
        _, cw_ref, counts = ref_top2(logits.detach(), cf, min_cap, drop=drop)
    else:
        _, cw_ref, counts = ref_topk(logits.detach(), k, cf, min_cap, drop=drop)
    mask = (cw_ref != 0).double()  # the routing decisions, constant
    gates = torch.softmax(logits, dim=1)
    kept = mask.sum(2)
    if k == 1:
        weights = gates * kept
    else:
        g = gates * kept
        weights = g / g.sum(1, keepdim=True).clamp(min=torch.finfo(torch.float32).eps)
    cw = mask * weights.unsqueeze(2)
    dispatched = torch.einsum("sec,sm->ecm", mask, xs)
    expert_out = torch.stack([experts[e](dispatched[e]) for e in range(E)])
    out = torch.einsum("sec,ecm->sm", cw, expert_out)
    me = gates.mean(0)
    if k == 1:
        l_aux = (me * counts.double() / S).sum() * E
    elif k == 2:
        first = torch.nn.functional.one_hot(gates.argmax(1), E).double().mean(0)
        l_aux = (me * first).mean() * E * E
    else:
        l_aux = (me * counts.double() / S).mean() * E * E / k
    leaves = [wg, *[p for e in experts for p in e.parameters()]]
    if moe.use_residual:
        mlp = copy.deepcopy(moe.mlp).double()
        coef_layer = copy.deepcopy(moe.coefficient).double()
        coef = torch.softmax(coef_layer(xs), dim=-1)
        out = out * coef[..., 0:1] + mlp(xs) * coef[..., 1:]
        leaves += [*mlp.parameters(), *coef_layer.parameters()]
    return out.reshape(x.shape), l_aux, counts, leaves + [xs]


def ours_with_grads(moe: MoE, x: torch.Tensor, seed=None):
    xs = x.clone().requires_grad_(True)
    if seed is not None:
        torch.manual_seed(seed)
    out, l_aux, counts = moe(xs)
    loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() + 0.3 * l_aux
    loss.backward()
    grads = [moe.deepspeed_moe.gate.wg.weight.grad,
             *[p.grad for e in moe.deepspeed_moe.experts.deepspeed_experts for p in e.parameters()]]
    if moe.use_residual:
        grads += [*[p.grad for p in moe.mlp.parameters()], *[p.grad for p in moe.coefficient.parameters()]]
    return out, l_aux, counts, grads + [xs.grad]


@pytest.mark.parametrize("k,cf,drop,residual", [(1, 1.0, True, False), (1, 0.5, True, True), (2, 0.5, True, False),
                                                (2, 1.0, False, True), (3, 0.6, True, False)])
def test_layer_matches_dense_float64_formulation(k, cf, drop, residual):
    torch.manual_seed(k * 10 + int(cf * 10))
    moe = MoE(H, expert_mlp(), num_experts=6, k=k, capacity_factor=cf, min_capacity=2, drop_tokens=drop,
              use_rts=False, use_residual=residual, top2_2nd_expert_sampling=False)
    x = torch.randn(4, 10, H)
    out, l_aux, counts, grads = ours_with_grads(moe, x)
    r_out, r_l_aux, r_counts, leaves = reference_forward(moe, x, k, cf, 2, drop)
    loss = (r_out * torch.linspace(-1, 1, r_out.numel(), dtype=torch.float64).view_as(r_out)).sum() + 0.3 * r_l_aux
    loss.backward()
    assert torch.equal(counts, r_counts)
    torch.testing.assert_close(out.double(), r_out.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l_aux.double(), r_l_aux.detach(), rtol=1e-5, atol=1e-6)
    assert len(grads) == len(leaves)
    for g, leaf in zip(grads, leaves):
        ref = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        torch.testing.assert_close(g.double().reshape(ref.shape), ref, rtol=1e-4, atol=1e-5)


def test_random_token_selection_uses_the_seeded_draw():
    torch.manual_seed(1)
    moe = MoE(H, expert_mlp(), num_experts=4, k=1, capacity_factor=0.5, min_capacity=2, use_rts=True)
    x = torch.randn(32, H)
    out, _, _, _ = ours_with_grads(moe, x, seed=9)
    torch.manual_seed(9)
    uniform = torch.rand(32, 4)
    r_out, _, _, _ = reference_forward(moe, x, 1, 0.5, 2, True, uniform=uniform)
    torch.testing.assert_close(out.double(), r_out.detach(), rtol=1e-5, atol=1e-5)


def test_eval_uses_eval_capacity_factor_and_noise_only_in_training():
    torch.manual_seed(2)
    moe = MoE(H, expert_mlp(), num_experts=4, k=1, capacity_factor=0.25, eval_capacity_factor=2.0, min_capacity=1,
              noisy_gate_policy="Jitter", use_rts=False)
    x = torch.randn(40, H)
    moe.eval()
    with torch.no_grad():
        out, _, _ = moe(x)
        again, _, _ = moe(x)
    assert torch.equal(out, again)  # no jitter in eval
    r_out, _, _, _ = reference_forward(moe, x, 1, 2.0, 1, True)
    torch.testing.assert_close(out.double(), r_out.detach(), rtol=1e-5, atol=1e-5)
    moe.train()
    torch.manual_seed(4)
    noisy, _, _ = moe(x)
    torch.manual_seed(4)
    from deepspeed_c.moe.sharded_moe import multiplicative_jitter

    jittered = multiplicative_jitter(x.float(), device=x.device)
    r = moe.deepspeed_moe.gate
    torch.manual_seed(4)
    routed = r.route(x)
    logits = jittered @ r.wg.weight.t()
    assert torch.equal(routed.idx[:, 0], torch.softmax(logits, 1).argmax(1))
    assert noisy.shape == x.shape


def test_rsample_selects_by_noisy_logits():
    from deepspeed_c.moe.sharded_moe import gumbel_rsample, top1gating

    logits = torch.randn(24, 5)
    torch.manual_seed(3)
    _, cw, _, _ = top1gating(logits, 4.0, 1, noisy_gate_policy="RSample", use_rts=False)
    torch.manual_seed(3)
    chosen = (logits + gumbel_rsample(logits.shape, logits.device)).argmax(1)
    assert torch.equal(cw.sum(2).argmax(1), chosen)


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match=r"\(6\).*ep_size=4"):
        MoE(H, expert_mlp(), num_experts=6, ep_size=4)
    with pytest.raises(AssertionError, match="k=7"):  # DeepSpeed asserts; ours is both a ValueError and that
        MoE(H, expert_mlp(), num_experts=6, k=7)
    with pytest.raises(ValueError, match="'Loud'"):
        MoE(H, expert_mlp(), num_experts=2, noisy_gate_policy="Loud")
    moe = MoE(H, nn.Linear(H, H + 1), num_experts=2)
    with pytest.raises(ValueError, match=r"expert 0 \(Linear\) returned shape .*13"):
        moe(torch.randn(8, H))
    from deepspeed_c.utils.groups import expert_layout

    with pytest.raises(ValueError, match="ep_size=8 is larger than the world size"):
        expert_layout(4, 8)
    with pytest.raises(ValueError, match="ep_size=3 does not divide the world size"):
        expert_layout(4, 3)


def test_expert_layout_and_param_marks():
    from deepspeed_c.utils.groups import expert_layout

    assert expert_layout(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert expert_layout(4, 2, True) == ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
    moe = MoE(H, expert_mlp(), num_experts=4, ep_size=2)
    experts = list(moe.deepspeed_moe.experts.parameters())
    assert len(moe.deepspeed_moe.experts.deepspeed_experts) == 2
    assert all(is_moe_param(p) and p.group_name == "ep_size_2" for p in experts)
    assert not is_moe_param(moe.deepspeed_moe.gate.wg.weight)


def test_split_params_into_moe_groups():
    a = MoE(H, expert_mlp(), num_experts=4, ep_size=2)
    b = MoE(H, expert_mlp(), num_experts=4, ep_size=4)
    dense = nn.Linear(H, H)
    params = [*dense.parameters(), *a.parameters(), *b.parameters()]
    groups = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "g", "lr": 0.1},
                                                                  max_group_size=600)
    assert groups[0]["name"] == "g" and not any(is_moe_param(p) for p in groups[0]["params"])
    moe_groups = groups[1:]
    assert all(g["moe"] and g["lr"] == 0.1 for g in moe_groups)
    for name, layer in (("ep_size_2", a), ("ep_size_4", b)):
        mine = [g for g in moe_groups if g["name"] == name]
        got = [p for g in mine for p in g["params"]]
        assert got == list(layer.deepspeed_moe.experts.parameters())
        assert all(sum(p.numel() for p in g["params"]) <= 600 for g in mine)
        # an expert holds 12*20+20+20*12+12 = 512 elements: two local experts need two groups of <= 600
        assert len(mine) == layer.num_local_experts
    total = sum(len(g["params"]) for g in groups)
    assert total == len(params)
