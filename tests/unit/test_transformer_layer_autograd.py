"""DeepSpeedTransformerLayer's one autograd node under the ways users call autograd (host path, fp32, a stack of
two layers with two outputs used by the loss): autograd.grad on inputs and weights equals .backward; reentrant and
non-reentrant activation checkpointing equal the plain run; two accumulated micro-steps equal the sum of their
gradients; backward(inputs=[x]) leaves the weights' .grad untouched."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from deepspeed_c.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer

H, HEADS, INTER, B, S = 32, 4, 64, 2, 9


def _stack(pre_ln: bool) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    cfg = dict(batch_size=B, hidden_size=H, intermediate_size=INTER, heads=HEADS, attn_dropout_ratio=0.0,
               hidden_dropout_ratio=0.0, num_hidden_layers=2, initializer_range=0.2, pre_layer_norm=pre_ln)
    return torch.nn.ModuleList(DeepSpeedTransformerLayer(DeepSpeedTransformerConfig(**cfg)) for _ in range(2))


def _loss(layers, x, mask, ckpt=None):
    h1 = layers[0](x, mask) if ckpt is None else checkpoint(layers[0], x, mask, use_reentrant=ckpt)
    h2 = layers[1](h1, mask) if ckpt is None else checkpoint(layers[1], h1, mask, use_reentrant=ckpt)
    return (h2 ** 2).mean() + 0.5 * h1.sum().tanh()  # both layers' outputs feed the loss


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, generator=g, requires_grad=True)
    keep = torch.rand(B, S, generator=g) > 0.3
    keep[:, 0] = True
    return x, (~keep).float()[:, None, None, :] * -1e4


def _grads(layers, x):
    return [x.grad.clone()] + [p.grad.clone() for p in layers.parameters()]


@pytest.mark.parametrize("pre_ln", [False, True])
def test_autograd_paths_agree(pre_ln):
    layers = _stack(pre_ln)
    x, mask = _inputs(1)
    _loss(layers, x, mask).backward()
    ref = _grads(layers, x)

    got = torch.autograd.grad(_loss(layers, x, mask), [x, *layers.parameters()])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    for reentrant in (True, False):
        layers.zero_grad(set_to_none=True)
        x.grad = None
        _loss(layers, x, mask, ckpt=reentrant).backward()
        for a, b in zip(_grads(layers, x), ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    layers.zero_grad(set_to_none=True)
    x.grad = None
    _loss(layers, x, mask).backward(inputs=[x])
    torch.testing.assert_close(x.grad, ref[0], rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for p in layers.parameters())


def test_accumulated_micro_steps_sum():
    layers = _stack(False)
    (x1, m1), (x2, m2) = _inputs(2), _inputs(3)
    parts = []
    for x, m in ((x1, m1), (x2, m2)):
        layers.zero_grad(set_to_none=True)
        _loss(layers, x, m).backward()
        parts.append([p.grad.clone() for p in layers.parameters()])
    layers.zero_grad(set_to_none=True)
    _loss(layers, x1, m1).backward()
    _loss(layers, x2, m2).backward()
    for p, a, b in zip(layers.parameters(), *parts):
        torch.testing.assert_close(p.grad, a + b, rtol=1e-5, atol=1e-7)
