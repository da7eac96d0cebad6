"""The MoE gating core (C, through deepspeed_c.moe.gating / sharded_moe) against float64 references of
DeepSpeed's gating formulas written out below (one-hot masks, cumulative sums, einsum dispatch and
combine), and, opt-in with DSC_DEEPSPEED_REAL, against the real DeepSpeed's gating functions on CPU."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from deepspeed_c.moe import gating_core as core
from deepspeed_c.moe.sharded_moe import top1gating, top2gating, topkgating

from tests.unit.moe_reference import ref_top1, ref_top2, ref_topk


def _check(ours, ref):
    l_aux, cw, mask, counts = ours
    r_l_aux, r_cw, r_counts = ref
    assert torch.equal(counts.cpu(), r_counts), (counts, r_counts)
    assert cw.shape == r_cw.shape, (cw.shape, r_cw.shape)
    assert torch.equal(mask, r_cw != 0)
    torch.testing.assert_close(cw.double(), r_cw, rtol=1e-5, atol=1e-6)
    assert abs(float(l_aux) - r_l_aux) <= 1e-5 * max(1.0, abs(r_l_aux))


CASES = [(64, 8), (37, 5), (128, 16)]


@pytest.mark.parametrize("S,E", CASES)
@pytest.mark.parametrize("cf,drop", [(1.0, True), (0.5, True), (1.0, False)])
def test_top1_matches_reference(S, E, cf, drop):
    torch.manual_seed(S + E)
    logits = torch.randn(S, E) * 2
    _check(top1gating(logits, cf, 4, drop_tokens=drop, use_rts=False), ref_top1(logits, cf, 4, drop=drop))
    # random token selection: the same seed gives the same uniforms to ours and the reference
    torch.manual_seed(7)
    ours = top1gating(logits, cf, 4, drop_tokens=drop, use_rts=True)
    torch.manual_seed(7)
    _check(ours, ref_top1(logits, cf, 4, drop=drop, uniform=torch.rand(S, E)))
    used = (torch.arange(S) % 3 != 0).long()
    _check(top1gating(logits, cf, 4, used_token=used, drop_tokens=drop, use_rts=False),
           ref_top1(logits, cf, 4, used=used, drop=drop))


@pytest.mark.parametrize("S,E", CASES)
@pytest.mark.parametrize("cf,drop", [(1.0, True), (0.4, True), (1.0, False)])
def test_top2_matches_reference(S, E, cf, drop):
    torch.manual_seed(S * E)
    logits = torch.randn(S, E)
    _check(top2gating(logits, cf, 4, drop_tokens=drop, top2_2nd_expert_sampling=False),
           ref_top2(logits, cf, 4, drop=drop))
    torch.manual_seed(11)
    ours = top2gating(logits, cf, 4, drop_tokens=drop, top2_2nd_expert_sampling=True)
    torch.manual_seed(11)
    noise = torch.distributions.gumbel.Gumbel(torch.tensor(0.0), torch.tensor(1.0)).rsample((S, E))
    _check(ours, ref_top2(logits, cf, 4, drop=drop, noise=noise))


@pytest.mark.parametrize("S,E,k", [(64, 8, 3), (50, 6, 4), (40, 8, 8)])
@pytest.mark.parametrize("cf,drop,policy", [(1.0, True, "probs"), (0.5, True, "probs"), (0.5, True, "position"),
                                            (1.0, False, "probs")])
def test_topk_matches_reference(S, E, k, cf, drop, policy):
    torch.manual_seed(S + k)
    logits = torch.randn(S, E)
    _check(topkgating(logits, k, cf, 4, drop_tokens=drop, drop_policy=policy),
           ref_topk(logits, k, cf, 4, drop=drop, policy=policy))


def test_sparse_routes_tuple_has_deepspeeds_layout():
    torch.manual_seed(0)
    logits = torch.randn(32, 4)
    l_aux, cap, E, indices, locations, gates, counts = top2gating(logits, 0.5, 2, sparse_routes=True,
                                                                  top2_2nd_expert_sampling=False)
    _, cw, _, _ = top2gating(logits, 0.5, 2, top2_2nd_expert_sampling=False)
    assert indices.shape == (2, 32) and indices.dtype == torch.int32 and locations.dtype == torch.int32
    assert E == 4 and int(cap) == cw.shape[2]
    for r in range(2):
        for s in range(32):
            e = int(indices[r, s])
            if e < 0:
                continue
            assert float(cw[s, e, int(locations[r, s])]) == pytest.approx(float(gates[r, s]))


# ---- dispatch / combine -----------------------------------------------------------------------------


def _routing(S=48, E=6, k=2, cf=0.6, seed=0):
    from deepspeed_c.moe.gating import route_top2, route_topk

    torch.manual_seed(seed)
    logits = torch.randn(S, E, requires_grad=True)
    if k == 2:
        return logits, route_top2(logits, cf, 2, top2_2nd_expert_sampling=False)
    return logits, route_topk(logits, k, cf, 2)


@pytest.mark.parametrize("k", [2, 3])
def test_dispatch_and_combine_equal_the_einsum_formulation(k):
    from deepspeed_c.moe.gating import dense_combine_weights

    _, r = _routing(k=k)
    S, M = r.idx.shape[0], 10
    cw, mask = dense_combine_weights(r)
    x = torch.randn(S, M, dtype=torch.float64)
    disp = core.dispatch(x, r.route_slot, r.slot_route).view(r.num_experts, r.capacity, M)
    torch.testing.assert_close(disp, torch.einsum("sec,sm->ecm", mask.double(), x), rtol=0, atol=0)
    y = torch.randn(r.num_experts * r.capacity, M, dtype=torch.float64)
    out = core.combine(y, r.weights.detach().double(), r.route_slot, r.slot_route)
    ref = torch.einsum("sec,ecm->sm", cw.detach().double(), y.view(r.num_experts, r.capacity, M))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_dispatch_and_combine_gradients():
    _, r = _routing()
    S, M = r.idx.shape[0], 5
    x = torch.randn(S, M, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: core.dispatch(t, r.route_slot, r.slot_route), (x,))
    y = torch.randn(r.num_experts * r.capacity, M, dtype=torch.float64, requires_grad=True)
    w = r.weights.detach().double().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: core.combine(a, b, r.route_slot, r.slot_route), (y, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_combine_accumulates_in_fp32_for_every_dtype(dtype):
    from deepspeed_c.moe.gating import dense_combine_weights

    _, r = _routing(k=3)
    M = 16
    y = torch.randn(r.num_experts * r.capacity, M).to(dtype)
    out = core.combine(y, r.weights.detach(), r.route_slot, r.slot_route)
    cw, _ = dense_combine_weights(r)
    ref = torch.einsum("sec,ecm->sm", cw.detach().float(), y.float().view(r.num_experts, r.capacity, M)).to(dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2 if dtype != torch.float32 else 1e-6, atol=1e-2)


def test_binding_refuses_bad_arguments_naming_them():
    op = core.op_for(torch.device("cpu"))
    idx = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(TypeError, match="'primary'"):
        op.select(torch.zeros(4, 3, dtype=torch.float64), None, 1, idx)
    with pytest.raises(ValueError, match="'k' must be in"):
        op.select(torch.zeros(4, 3), None, 4, torch.zeros(4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="'slot_route_out' must have shape"):
        op.plan(idx, None, None, 3, 2, 0, torch.empty(4, 2, dtype=torch.int64), torch.empty(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="expert id outside"):
        op.plan(idx + 7, None, None, 3, 2, 0, torch.empty(4, 2, dtype=torch.int64), torch.empty(6, dtype=torch.int64))
    with pytest.raises(ValueError, match="'order'"):
        op.plan(idx, None, None, 3, 2, 5, torch.empty(4, 2, dtype=torch.int64), torch.empty(6, dtype=torch.int64))
    with pytest.raises(TypeError, match="'out' must have the dtype of 'x'"):
        op.dispatch(torch.zeros(4, 3), torch.full((6,), -1, dtype=torch.int64), 2, None, torch.zeros(6, 3).half())
    with pytest.raises(ValueError, match="slot outside"):
        op.combine(torch.zeros(6, 3), torch.full((4, 2), 9, dtype=torch.int64), None, torch.zeros(4, 3))


def test_bad_gate_arguments_name_the_value():
    from deepspeed_c.moe.sharded_moe import TopKGate

    with pytest.raises(ValueError, match="k=5"):
        TopKGate(8, 4, k=5)
    with pytest.raises(ValueError, match="'Gumbel'"):
        TopKGate(8, 4, noisy_gate_policy="Gumbel")
    with pytest.raises(ValueError, match="min_capacity=16"):
        top1gating(torch.randn(8, 4), 1.0, 16)


# ---- the real DeepSpeed (opt-in) ----------------------------------------------------------------------

DS_SCRIPT = r"""
import sys, numpy as np, torch
from deepspeed.moe.sharded_moe import top1gating, top2gating, topkgating
d = np.load(sys.argv[1]); logits = torch.from_numpy(d["logits"])
out = {}
for name, fn in [("top1", lambda: top1gating(logits.clone(), 0.5, 4, use_rts=True)),
                 ("top2", lambda: top2gating(logits.clone(), 0.5, 4, top2_2nd_expert_sampling=True)),
                 ("top3", lambda: topkgating(logits.clone(), 3, 0.5, 4))]:
    torch.manual_seed(5)
    l_aux, cw, mask, counts = fn()
    out[name + "_l_aux"] = l_aux.detach().numpy(); out[name + "_cw"] = cw.detach().numpy()
    out[name + "_counts"] = counts.numpy()
np.savez(sys.argv[2], **out)
"""


def test_equals_real_deepspeed_gating(tmp_path):
    real = os.environ.get("DSC_DEEPSPEED_REAL")
    if not real:
        pytest.skip("runs the real DeepSpeed 0.19.8 when DSC_DEEPSPEED_REAL names the directory it is installed in "
                    "(the float64 references above check the formulas)")
    torch.manual_seed(3)
    logits = torch.randn(96, 8)
    np.savez(tmp_path / "in.npz", logits=logits.numpy())
    env = dict(os.environ, PYTHONPATH=f"{real}:/tmp/ds_deps", DS_ACCELERATOR="cpu")
    res = subprocess.run([sys.executable, "-c", DS_SCRIPT, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    theirs = np.load(tmp_path / "out.npz")
    for name, fn in [("top1", lambda: top1gating(logits.clone(), 0.5, 4, use_rts=True)),
                     ("top2", lambda: top2gating(logits.clone(), 0.5, 4, top2_2nd_expert_sampling=True)),
                     ("top3", lambda: topkgating(logits.clone(), 3, 0.5, 4))]:
        torch.manual_seed(5)
        l_aux, cw, _, counts = fn()
        np.testing.assert_array_equal(counts.numpy(), theirs[name + "_counts"])
        np.testing.assert_allclose(cw.detach().numpy(), theirs[name + "_cw"], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(float(l_aux), float(theirs[name + "_l_aux"]), rtol=1e-6)


def test_cuda_binding_refuses_host_tensors_before_any_cuda_call():
    from op_builder import toolchain

    if toolchain.nvcc() is None or not toolchain.cudart_static_available():
        pytest.skip("nvcc and libcudart_static are needed to build the CUDA gating op")
    from deepspeed_c.ops.op_builder import MoEGatingCUDABuilder

    op = MoEGatingCUDABuilder().load()
    with pytest.raises(ValueError, match="'x' must be on the cuda device"):
        op.dispatch(torch.zeros(4, 3), torch.full((6,), -1, dtype=torch.int64), 2, None, torch.zeros(6, 3))
    with pytest.raises(ValueError, match="'primary' must be on the cuda device"):
        op.select(torch.zeros(4, 3), None, 1, torch.zeros(4, 1, dtype=torch.int64))
