"""DeepSpeedTransformerLayer's GPU kernel path (cuDNN/SDPA attention core, stacked QKV gradient kernel, fused
LayerNorm backward, Philox dropout masks) under the ways users call autograd: autograd.grad on the input and the
weights equals .backward() bit for bit; two backwards through one retained graph add up; backward(inputs=[x]) leaves the weights' .grad untouched; two accumulated
backwards equal the sum of their gradients; a create_graph penalty and torch.func.grad match the plain-torch
layer of tests/unit/test_transformer_layer_higher_order.py (fp32 on the GPU, relative 1e-4: TF32 off); with
hidden dropout a create_graph backward replays the forward's masks. Skipped without a CUDA GPU."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer
from deepspeed_c.ops.transformer.transformer_function import WEIGHT_NAMES
from tests.unit.test_transformer_layer_higher_order import _reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

H, HEADS, INTER, B, S, EPS = 64, 4, 256, 4, 32, 1e-12


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _layer(dtype: torch.dtype, pre_ln: bool = False, dropout: float = 0.0) -> DeepSpeedTransformerLayer:
    torch.manual_seed(0)
    cfg = DeepSpeedTransformerConfig(batch_size=B, hidden_size=H, intermediate_size=INTER, heads=HEADS,
                                     attn_dropout_ratio=0.0, hidden_dropout_ratio=dropout, num_hidden_layers=1,
                                     initializer_range=0.1, pre_layer_norm=pre_ln, layer_norm_eps=EPS)
    layer = DeepSpeedTransformerLayer(cfg).cuda().to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return layer


def _inputs(dtype: torch.dtype, seed: int = 3):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(B, S, H, device="cuda", generator=g).to(dtype)
    keep = torch.arange(S, device="cuda")[None] < torch.tensor([S, S - 5, S // 2, 7], device="cuda")[:, None]
    return x, ((~keep).to(dtype) * -1e4)[:, None, None, :]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean() + out[:, 0].float().sum().tanh()


@pytest.mark.parametrize("pre_ln", [False, True])
def test_kernel_path_autograd_grad_inputs_and_accumulation(pre_ln):
    layer = _layer(torch.bfloat16, pre_ln)
    x0, mask = _inputs(torch.bfloat16)
    weights = [getattr(layer, n) for n in WEIGHT_NAMES]
    x = x0.clone().requires_grad_(True)
    _loss(layer(x, mask)).backward()
    ref = [x.grad.clone()] + [w.grad.clone() for w in weights]

    got = torch.autograd.grad(_loss(layer(x, mask)), [x, *weights])
    assert all(torch.equal(a, b) for a, b in zip(got, ref)), "autograd.grad differs from .backward()"
    assert all(torch.equal(w.grad, r) for w, r in zip(weights, ref[1:])), "autograd.grad touched .grad"

    layer.zero_grad(set_to_none=True)
    x.grad = None
    _loss(layer(x, mask)).backward(inputs=[x])
    assert torch.equal(x.grad, ref[0]) and all(w.grad is None for w in weights)

    # two losses of one forward, the graph retained between them (the node's attention state must survive)
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out = layer(x, mask)
    _loss(out).backward(retain_graph=True)
    assert torch.equal(x.grad, ref[0]), "the first of two retained backwards differs from a plain backward"
    out.float().sum().backward()
    once = torch.autograd.grad(_loss(layer(x, mask)) + layer(x, mask).float().sum(), [x])[0]
    assert _rel(x.grad, once) < 1e-2, ("retained backwards", _rel(x.grad, once))

    x2, _ = _inputs(torch.bfloat16, seed=5)
    x2.requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    _loss(layer(x2, mask)).backward()
    second = [w.grad.clone() for w in weights]
    layer.zero_grad(set_to_none=True)
    _loss(layer(x, mask)).backward()
    _loss(layer(x2, mask)).backward()
    for name, w, a, b in zip(WEIGHT_NAMES, weights, ref[1:], second):
        assert torch.equal(w.grad, a + b), f"{name}: two accumulated backwards are not the sum of their gradients"


@pytest.mark.parametrize("pre_ln", [False, True])
def test_kernel_path_create_graph_and_torch_func(pre_ln):
    layer = _layer(torch.float32, pre_ln)
    x0, mask = _inputs(torch.float32)
    params = dict(layer.named_parameters())
    ref_params = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    results = []
    for fwd, ps in ((lambda t: layer(t, mask), params), (lambda t: _reference(ref_params, t, mask, pre_ln, HEADS),
                                                          ref_params)):
        x = x0.clone().requires_grad_(True)
        loss = _loss(fwd(x))
        gx, gw = torch.autograd.grad(loss, [x, ps["attn_ow"]], create_graph=True)
        (loss + 0.7 * gx.pow(2).sum() + 0.3 * gw.norm()).backward()
        results.append([x.grad] + [ps[n].grad for n in WEIGHT_NAMES])
    for name, a, b in zip(["x", *WEIGHT_NAMES], *results):
        assert _rel(a, b) < 1e-4, (name, _rel(a, b))

    plain = {n: p.detach() for n, p in params.items()}
    got = torch.func.grad(lambda p: _loss(torch.func.functional_call(layer, p, (x0, mask))))(plain)
    want = torch.func.grad(lambda p: _loss(_reference(p, x0, mask, pre_ln, HEADS)))(plain)
    for n in plain:
        assert _rel(got[n], want[n]) < 1e-4, (n, _rel(got[n], want[n]))


def test_kernel_path_create_graph_replays_dropout_masks():
    layer = _layer(torch.float32, dropout=0.2)
    x0, mask = _inputs(torch.float32)
    grads = []
    for create_graph in (False, True):
        torch.manual_seed(11)
        x = x0.clone().requires_grad_(True)
        grads.append(torch.autograd.grad(_loss(layer(x, mask)), [x, layer.inter_w, layer.attn_qkvw],
                                         create_graph=create_graph))
    for a, b in zip(*grads):
        assert _rel(b, a) < 1e-4, _rel(b, a)


def test_fused_attention_dropout_refuses_create_graph():
    layer = _layer(torch.float32)
    layer.config.attn_dropout_ratio = 0.1
    x0, mask = _inputs(torch.float32)
    x = x0.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="attention dropout"):
        torch.autograd.grad(_loss(layer(x, mask)), x, create_graph=True)
