"""DeepSpeedTransformerLayer under the autograd uses its first-order node cannot serve by itself: create_graph
gradient penalties (input penalty as WGAN-GP / R1, a weight-gradient-norm penalty as GradNorm), double backward
(gradgradcheck), and torch.func (grad of functional_call, vmap per-sample gradients). Reference: the layer written
here in plain torch.nn.functional ops, float64, post- and pre-LN, with a padding mask; relative tolerance 1e-9
per tensor. With hidden dropout, a create_graph backward replays the forward's masks: its first-order gradients
equal a plain backward's from the same RNG state."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepspeed_c.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer

H, HEADS, INTER, B, S, EPS = 16, 4, 32, 3, 5, 1e-12


def _layer(pre_ln: bool, hidden_dropout: float = 0.0, invertible: bool = False) -> DeepSpeedTransformerLayer:
    torch.manual_seed(0)
    cfg = DeepSpeedTransformerConfig(batch_size=B, hidden_size=H, intermediate_size=INTER, heads=HEADS,
                                     attn_dropout_ratio=0.0, hidden_dropout_ratio=hidden_dropout,
                                     num_hidden_layers=1, initializer_range=0.3, pre_layer_norm=pre_ln,
                                     layer_norm_eps=EPS, normalize_invertible=invertible)
    layer = DeepSpeedTransformerLayer(cfg).double()
    with torch.no_grad():  # non-trivial biases and norms, so every weight's second-order terms show
        for p in layer.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return layer


def _reference(p: dict, x: torch.Tensor, mask: torch.Tensor, pre_ln: bool, heads: int = HEADS) -> torch.Tensor:
    hidden, seq = x.shape[-1], x.shape[1]

    def ln(t, w, b):
        return F.layer_norm(t, (hidden,), w, b, EPS)

    def attention(t):
        q, k, v = F.linear(t, p["attn_qkvw"], p["attn_qkvb"]).view(t.shape[0], seq, 3, heads, -1).unbind(2)
        q, k, v = (u.transpose(1, 2) for u in (q, k, v))
        probs = torch.softmax(q @ k.transpose(-1, -2) / (hidden // heads) ** 0.5 + mask, dim=-1)
        return F.linear((probs @ v).transpose(1, 2).reshape(t.shape), p["attn_ow"], p["attn_ob"])

    def ffn(t):
        return F.linear(F.gelu(F.linear(t, p["inter_w"], p["inter_b"])), p["output_w"], p["output_b"])

    if pre_ln:
        r1 = x + attention(ln(x, p["norm_w"], p["norm_b"]))
        return r1 + ffn(ln(r1, p["attn_nw"], p["attn_nb"]))
    h1 = ln(x + attention(x), p["attn_nw"], p["attn_nb"])
    return ln(h1 + ffn(h1), p["norm_w"], p["norm_b"])


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(B, S, H, generator=g, dtype=torch.float64)
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, -2:] = False
    return x, (~keep).double()[:, None, None, :] * -1e4


def _penalised(forward, params: dict, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    out = forward(x)
    loss = (out ** 2).mean() + out[:, 0].sum().tanh()
    gx, gw = torch.autograd.grad(loss, [x, params["attn_ow"]], create_graph=True)
    return loss + 0.7 * gx.pow(2).sum() + 0.3 * gw.norm(), x


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert err < 1e-9, f"{what}: rel err {err:.2e}"


@pytest.mark.parametrize("pre_ln", [False, True])
def test_create_graph_penalties_and_double_backward(pre_ln):
    layer = _layer(pre_ln)
    x0, mask = _inputs()
    params = dict(layer.named_parameters())
    total, x = _penalised(lambda t: layer(t, mask), params, x0)
    total.backward()
    ref_params = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    ref_total, xr = _penalised(lambda t: _reference(ref_params, t, mask, pre_ln), ref_params, x0)
    ref_total.backward()
    _close(total.detach(), ref_total.detach(), "penalised loss")
    _close(x.grad, xr.grad, "x.grad")
    for n, p in params.items():
        _close(p.grad, ref_params[n].grad, n)
    assert torch.autograd.gradgradcheck(lambda t: layer(t, mask[:1]), (x0[:1].clone().requires_grad_(True),),
                                        eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("pre_ln", [False, True])
def test_torch_func_grad_and_per_sample(pre_ln):
    layer = _layer(pre_ln)
    x, mask = _inputs()
    params = {n: p.detach() for n, p in layer.named_parameters()}

    def loss_of(fwd):
        return lambda p, t, m: (fwd(p, t, m) ** 2).mean()

    ours = loss_of(lambda p, t, m: torch.func.functional_call(layer, p, (t, m)))
    ref = loss_of(lambda p, t, m: _reference(p, t, m, pre_ln))
    got, want = torch.func.grad(ours)(params, x, mask), torch.func.grad(ref)(params, x, mask)
    for n in params:
        _close(got[n], want[n], f"func.grad {n}")
    # per-sample gradients of the weights (vmap over the batch, a sample as a batch of one)
    per = torch.func.vmap(torch.func.grad(lambda p, t, m: ours(p, t[None], m[None])), in_dims=(None, 0, 0))
    got = per(params, x, mask)
    for b in range(B):
        want = torch.func.grad(ref)(params, x[b:b + 1], mask[b:b + 1])
        for n in params:
            _close(got[n][b], want[n], f"per-sample {b} {n}")


def test_create_graph_replays_dropout_masks():
    layer = _layer(False, hidden_dropout=0.3)
    x0, mask = _inputs()
    grads = []
    for create_graph in (False, True):
        layer.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        x = x0.clone().requires_grad_(True)
        out = layer(x, mask)
        gx, gw = torch.autograd.grad((out ** 2).mean(), [x, layer.inter_w], create_graph=create_graph)
        grads.append((gx.detach(), gw.detach()))
        if create_graph:
            assert gx.requires_grad and gw.requires_grad
    for a, b in zip(*grads):
        _close(a, b, "first-order gradient of the create_graph backward")


def test_create_graph_needs_the_kept_input():
    layer = _layer(True, invertible=True)
    x0, mask = _inputs()
    x = x0.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="normalize_invertible"):
        torch.autograd.grad((layer(x, mask) ** 2).mean(), x, create_graph=True)
