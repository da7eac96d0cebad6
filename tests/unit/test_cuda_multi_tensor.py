"""GPU tests of the multi-tensor utility kernels (op multi_tensor_ops) against float64
references: L2 norm with inf/nan flag, scale, casting copy, flatten/unflatten, and the fused
AdamW epilogue. Fresh random inputs, ragged and misaligned lists, poisoned outputs, and lists
longer than one launch holds."""
from __future__ import annotations

import random

import pytest
import torch

from tests.unit.cuda_reference import (NEEDS_GPU, RAGGED, adam_ref, assert_half_close, assert_rel, make, poison,
                                       rel_err)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_GPU)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def mt():
    from deepspeed_c.ops import cuda_multi_tensor

    return cuda_multi_tensor


def _raw_norm(mt, tensors, per_tensor=True):
    """Calls the binding with NaN-poisoned outputs and scratch, so unwritten results show."""
    n = len(tensors)
    scratch = torch.full((n + 2,), float("nan"), dtype=torch.float64, device="cuda")
    norm = torch.full((1,), float("nan"), device="cuda")
    found = torch.full((1,), float("nan"), device="cuda")
    per = torch.full((n,), float("nan"), device="cuda") if per_tensor else None
    mt._ops().l2norm(tensors, scratch, norm, per, found)
    return norm, per, found


@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_l2norm_mixed_dtypes_ragged(mt, misalign):
    tensors = []
    for dt in DTYPES:  # one list, three dtype groups
        tensors += make(RAGGED, dt, misalign=misalign)
    random.shuffle(tensors)
    norm, per, found = _raw_norm(mt, tensors)
    ref_per = torch.stack([t.double().norm() for t in tensors])
    ref = ref_per.norm()
    assert found.item() == 0.0
    assert rel_err(norm, ref.reshape(1)) <= 1e-5
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            assert per[i].item() == 0.0
        else:
            assert rel_err(per[i], ref_per[i]) <= 1e-5, (i, t.numel(), t.dtype)


def test_l2norm_many_tensors_several_launches(mt):
    n = mt.tensors_per_launch(1) + 465
    tensors = make([random.randint(0, 300) for _ in range(n)], torch.float32)
    norm, per, found = _raw_norm(mt, tensors)
    ref_per = torch.stack([t.double().norm() for t in tensors])
    assert rel_err(per, ref_per) <= 1e-5 and rel_err(norm, ref_per.norm().reshape(1)) <= 1e-5
    assert found.item() == 0.0
    # the front end without per-tensor output agrees
    g = mt.multi_tensor_global_norm(tensors)
    assert rel_err(g.reshape(1), ref_per.norm().reshape(1)) <= 1e-5


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm_reports_nonfinite(mt, bad, dtype):
    tensors = make([100, 40001, 7], dtype)
    tensors[1][12345] = bad
    norm, per, found = _raw_norm(mt, tensors)
    assert found.item() == 1.0
    assert not torch.isfinite(norm).any(), "a NaN/inf passed silently through the norm"
    assert not torch.isfinite(per[1]) and torch.isfinite(per[[0, 2]]).all()


def test_l2norm_huge_finite_is_not_inf(mt):
    t = torch.randn(1000, device="cuda")
    t[3] = 1e20  # its square overflows fp32, the value does not
    norm, _, found = _raw_norm(mt, [t], per_tensor=False)
    assert found.item() == 0.0
    assert rel_err(norm, t.double().norm().reshape(1)) <= 1e-5


def test_l2norm_empty_list_writes_outputs(mt):
    norm, per, found = mt.multi_tensor_l2norm([], per_tensor=True, device="cuda")
    assert norm.item() == 0.0 and found.item() == 0.0 and per.numel() == 0


@pytest.mark.parametrize("src_dt", DTYPES)
@pytest.mark.parametrize("dst_dt", DTYPES)
def test_copy_all_dtype_pairs(mt, src_dt, dst_dt):
    for misalign in (False, True):
        src = make(RAGGED, src_dt, misalign=misalign, scale=3.0)
        dst = poison([torch.empty(t.numel(), dtype=dst_dt, device="cuda") for t in src])
        mt.multi_tensor_copy_(src, dst)
        for s, d in zip(src, dst):
            # one rounding from the exact source value: identical to a float64 reference cast
            assert torch.equal(d, s.double().to(dst_dt)), (s.numel(), misalign)


@pytest.mark.parametrize("src_dt", DTYPES)
def test_scale_unscale_and_flag(mt, src_dt):
    src = make(RAGGED, src_dt, scale=100.0)
    dst = poison([torch.empty(t.numel(), dtype=torch.float32, device="cuda") for t in src])
    found = torch.zeros(1, device="cuda")
    mt.multi_tensor_scale_(src, dst, 1.0 / 1024, found)
    assert found.item() == 0.0
    assert_rel(dst, [s.double() / 1024 for s in src], 1e-6, "dst")
    src[5][2] = float("inf")
    mt.multi_tensor_scale_(src, dst, 0.5, found)
    assert found.item() == 1.0
    mt.multi_tensor_scale_(make([10], src_dt), make([10], torch.float32), 0.5, found)
    assert found.item() == 1.0, "found_inf must never be cleared"


def test_unscale_in_place_with_device_scale(mt):
    ts = make(RAGGED, torch.float32)
    ref = [t.double() * 0.125 for t in ts]
    found = torch.zeros(1, device="cuda")
    mt.non_finite_check_and_unscale_(ts, found, torch.tensor([0.125], device="cuda"))
    assert found.item() == 0.0
    assert_rel(ts, ref, 1e-7, "tensors")


@pytest.mark.parametrize("flat_dt", DTYPES)
def test_flatten_unflatten(mt, flat_dt):
    src = make(RAGGED, torch.float32, misalign=True) + make(RAGGED, torch.bfloat16)
    flat = mt.flatten(src, dtype=flat_dt)
    ref = torch.cat([t.double().flatten() for t in src]).to(flat_dt)
    assert torch.equal(flat, ref)
    # into a poisoned buffer through the binding
    flat2 = torch.full_like(flat, float("nan"))
    mt._ops().flatten(src, flat2)
    assert torch.equal(flat2, ref)
    back = poison([torch.empty_like(t) for t in src])
    mt.unflatten_copy_(flat, back)
    for b, s in zip(back, src):
        assert torch.equal(b, s.double().to(flat_dt).to(s.dtype))
    views = mt.unflatten(flat, src)
    assert all(v.shape == s.shape and v.dtype == flat_dt for v, s in zip(views, src))
    with pytest.raises(ValueError, match="'flat' has"):
        mt._ops().flatten(src, flat[1:])


def _epilogue_case(n_sizes, model_dt, loss_scale, max_norm, adam_w_mode=True, bias_correction=True):
    masters = make(n_sizes, torch.float32)
    grads = [g.to(model_dt) for g in make(n_sizes, torch.float32, scale=loss_scale * 0.01)]
    ms = make(n_sizes, torch.float32, scale=0.01)
    vs = make(n_sizes, torch.float32, scale=1e-4, positive=True)
    model = poison([torch.empty(t.numel(), dtype=model_dt, device="cuda") for t in masters])
    return masters, grads, ms, vs, model


@pytest.mark.parametrize("model_dt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_norm", [0.0, 1e-3, 1e9], ids=["noclip", "clip", "loose"])
@pytest.mark.parametrize("mode", [(True, True), (False, True), (True, False)], ids=["adamw", "l2", "nobc"])
def test_adam_epilogue(mt, model_dt, max_norm, mode):
    adam_w_mode, bias_correction = mode
    ls, lr, betas, eps, wd = 1024.0, 1e-3, (0.9, 0.999), 1e-8, 0.01
    masters, grads, ms, vs, model = _epilogue_case(RAGGED, model_dt, ls, max_norm)
    before = [[t.clone() for t in lst] for lst in (masters, ms, vs)]
    norm, _, found = mt.multi_tensor_l2norm(grads)
    step = torch.tensor([5.0], device="cuda")
    mt.fused_adam_epilogue_(grads, masters, ms, vs, step=step, grad_norm=norm, found_inf=found,
                            model_params=model, lr=lr, betas=betas, eps=eps, weight_decay=wd,
                            adam_w_mode=adam_w_mode, bias_correction=bias_correction, loss_scale=ls,
                            max_grad_norm=max_norm)
    total = torch.stack([g.double().norm() for g in grads]).norm().item()
    factor = ls
    if max_norm > 0:
        clip = (total / ls + 1e-6) / max_norm
        if clip > 1:
            factor = ls * clip
    for i in range(len(masters)):
        p, m, v = adam_ref(before[0][i], grads[i], before[1][i], before[2][i], lr=lr, beta1=betas[0],
                           beta2=betas[1], eps=eps, step=6, weight_decay=wd, adam_w_mode=adam_w_mode,
                           bias_correction=bias_correction, grad_scale=factor)
        assert_rel([masters[i], ms[i], vs[i]], [p, m, v], 1e-5, f"tensor {i} (master, m, v)")
        assert torch.equal(model[i], masters[i].to(model_dt)), f"model copy {i}"
    assert step.item() == 6.0


@pytest.mark.parametrize("how", ["nan_grad", "found_inf"])
def test_adam_epilogue_skips_on_overflow(mt, how):
    masters, grads, ms, vs, model = _epilogue_case(RAGGED, torch.bfloat16, 1024.0, 1.0)
    if how == "nan_grad":
        grads[9][7] = float("nan")
        norm, _, found = mt.multi_tensor_l2norm(grads)
        assert found.item() == 1.0
    else:
        norm = torch.tensor([3.0], device="cuda")
        found = torch.tensor([1.0], device="cuda")
    before = [[t.clone() for t in lst] for lst in (masters, ms, vs)]
    step = torch.tensor([5.0], device="cuda")
    mt.fused_adam_epilogue_(grads, masters, ms, vs, step=step, grad_norm=norm, found_inf=found,
                            model_params=model, lr=1e-3, loss_scale=1024.0, max_grad_norm=1.0)
    for lst, ref in zip((masters, ms, vs), before):
        for a, b in zip(lst, ref):
            assert torch.equal(a, b), "a skipped step must write nothing"
    assert all(torch.isnan(t).all() for t in model if t.numel()), "a skipped step must write nothing"
    assert step.item() == 5.0


def test_epilogue_and_norm_capture_in_cuda_graph(mt):
    """The kernels use torch's current stream and never synchronise, so a graph captures them."""
    masters, grads, ms, vs, model = _epilogue_case([4097, 33], torch.bfloat16, 1.0, 0.0)
    ref = [t.clone() for t in masters], [t.clone() for t in ms], [t.clone() for t in vs]
    step = torch.tensor([0.0], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        # warm-up on the side stream: loads every kernel before capture; found_inf skips the step
        norm, _, _ = mt.multi_tensor_l2norm(grads)
        mt.fused_adam_epilogue_(grads, masters, ms, vs, step=step, grad_norm=norm,
                                found_inf=torch.ones(1, device="cuda"), model_params=model, lr=1e-3)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=side):
            norm, _, found = mt.multi_tensor_l2norm(grads)
            mt.fused_adam_epilogue_(grads, masters, ms, vs, step=step, grad_norm=norm, found_inf=found,
                                    model_params=model, lr=1e-3, weight_decay=0.0)
    torch.cuda.synchronize()
    step.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for i in range(2):
        p, m, v = adam_ref(ref[0][i], grads[i], ref[1][i], ref[2][i], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                           step=1, weight_decay=0.0)
        assert_rel([masters[i], ms[i], vs[i]], [p, m, v], 1e-5, f"graph tensor {i}")
    assert step.item() == 1.0
    assert_half_close(model, [t.double() for t in masters], "model")
