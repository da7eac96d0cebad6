"""The transformer layer's newer CUDA pieces against their references. Dropout keep masks (transformer_dropout.cu):
the Philox kernel's masks equal the numpy reference bit for bit, and the layer's masks follow torch's CUDA RNG
state, so restoring the state (as reentrant activation checkpointing does) replays them. The stacked QKV gradient
with its bias sums (transformer_qkv_grad.cu) and the LayerNorm backward's two-rows-a-block form (odd row counts,
every option) against fused_reference. Needs a CUDA GPU; skipped elsewhere."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils.checkpoint as cp

from deepspeed_c.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer
from deepspeed_c.ops.transformer import fused_ops
from deepspeed_c.ops.transformer import fused_reference as ref
from deepspeed_c.ops.transformer.philox_reference import dropout_keep, keep_threshold
from deepspeed_c.ops.transformer.transformer_function import WEIGHT_NAMES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("n,seed,offset", [(1, 0, 0), (15, 1, 4), (16, 2**63 + 5, 8), (17, 7, 2**40 + 4),
                                           (4099, 123, 12), ((1 << 20) + 3, 2**64 - 1, 2**64 - 4)])
def test_kernel_mask_equals_reference(n, seed, offset):
    thr = keep_threshold(0.1)
    keep = torch.empty(n, dtype=torch.uint8, device="cuda")
    fused_ops.cuda_op().dropout_keep(keep, thr, seed, offset)
    np.testing.assert_array_equal(keep.cpu().numpy(), dropout_keep(n, thr, seed, offset))


def test_unaligned_mask_view_equals_reference():
    thr = keep_threshold(0.25)
    buf = torch.empty(1000, dtype=torch.bool, device="cuda")
    fused_ops.cuda_op().dropout_keep(buf[3:], thr, 99, 0)
    np.testing.assert_array_equal(buf[3:].cpu().numpy().astype(np.uint8), dropout_keep(997, thr, 99, 0))


def test_keep_mask_advances_the_generator_and_replays_from_its_state():
    g = torch.Generator(device="cuda").manual_seed(5)
    state = g.get_state()
    a = fused_ops.keep_mask((64, 1024), 0.1, torch.device("cuda"), g)
    b = fused_ops.keep_mask((64, 1024), 0.1, torch.device("cuda"), g)
    assert not torch.equal(a, b)
    assert abs(a.float().mean().item() - 0.9) < 0.01
    g.set_state(state)
    assert torch.equal(fused_ops.keep_mask((64, 1024), 0.1, torch.device("cuda"), g), a)


def _layer() -> DeepSpeedTransformerLayer:
    torch.manual_seed(0)
    cfg = DeepSpeedTransformerConfig(batch_size=2, hidden_size=128, intermediate_size=512, heads=4,
                                     attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1, num_hidden_layers=1,
                                     initializer_range=0.02)
    return DeepSpeedTransformerLayer(cfg).cuda().to(torch.bfloat16)


def test_layer_dropout_follows_cuda_rng_state_and_checkpoint_replays_it():
    layer = _layer()
    x = torch.randn(2, 64, 128, device="cuda").to(torch.bfloat16)
    state = torch.cuda.get_rng_state()
    out1 = layer(x)
    torch.cuda.set_rng_state(state)
    out2 = layer(x)
    assert torch.equal(out1, out2)
    assert not torch.equal(layer(x), out1)  # the state moved on: other masks

    grads = []
    for reentrant in (None, True):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        torch.cuda.set_rng_state(state)
        out = layer(xi) if reentrant is None else cp.checkpoint(layer, xi, use_reentrant=True)
        out.float().pow(2).sum().backward()
        grads.append([out, xi.grad] + [getattr(layer, n).grad for n in WEIGHT_NAMES])
    for name, a, b in zip(["out", "dx", *WEIGHT_NAMES], grads[1], grads[0]):
        assert torch.equal(a, b), name


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,cols,offset", [(301, 1024, 0), (7, 768, 0), (5, 13, 0), (64, 256, 3)])
def test_stack_qkv_grad_equals_reference(dtype, rows, cols, offset):
    g = torch.Generator(device="cuda").manual_seed(rows + cols)
    ins = [torch.randn(rows * cols + offset, device="cuda", generator=g).to(dtype)[offset:].view(rows, cols)
           for _ in range(3)]
    out, db = fused_ops.stack_qkv_grad(*ins)
    want, wdb = ref.stack_qkv_grad(*(t.float() for t in ins))
    assert torch.equal(out.float(), want)
    assert _rel(db, wdb) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,cols", [(301, 1024), (33, 768), (1, 512), (9, 4096)])
def test_norm_backward_equals_reference(dtype, rows, cols):
    g = torch.Generator(device="cuda").manual_seed(rows * cols)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    gamma, beta = (1 + 0.1 * r(cols)).to(dtype), (0.1 * r(cols)).to(dtype)
    x, res, dy = r(rows, cols).to(dtype), r(rows, cols).to(dtype), r(rows, cols).to(dtype)
    keep = torch.rand(rows, cols, device="cuda", generator=g) > 0.1
    src, y, mean, rstd = ref.residual_norm(x, None, None, None, 1.0, gamma, beta, 1e-5, want_r=True)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for inv, extra, kp, want_bias in ((False, None, None, False), (False, res, keep, True), (True, None, keep, True)):
        args = (dy, y if inv else src, gamma, beta, None if inv else mean, rstd, inv, extra, kp, 1 / 0.9, want_bias)
        for name, a, b in zip(("dx", "dgamma", "dbeta", "dxd", "dbias"), fused_ops.norm_backward(*args),
                              ref.norm_backward(*args)):
            if b is not None:
                assert _rel(a, b) < tol, (name, inv, _rel(a, b))
