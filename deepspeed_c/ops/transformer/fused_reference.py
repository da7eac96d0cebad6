"""Torch forms of the transformer layer's fused pieces (csrc/cuda/transformer_*.cu): the host
path of DeepSpeedTransformerLayer and the reference its CUDA kernels are checked against. Same
contracts as `fused_ops`: statistics (mean, rstd) are float32 ([rows]; float64 for float64
inputs), the pre-activation u = f + bias is rounded to the activation dtype before GELU and formed
again from f and the bias wherever it is needed (never stored)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _math_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _pre_activation(f: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """u = f + bias rounded to f's dtype (the kernels' u)."""
    return f if bias is None else f + bias


def bias_gelu(f: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(f, gelu(f + bias)): f, not u, is what gelu and gelu_backward take again with the bias."""
    return f, gelu(f, bias)


def gelu(f: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    u = _pre_activation(f, bias)
    return F.gelu(u.to(_math_dtype(u))).to(u.dtype)


def gelu_backward(dg: torch.Tensor, f: torch.Tensor, bias: torch.Tensor | None = None, want_bias: bool = False):
    """(dg * gelu'(f + bias), its column sums over the rows (the bias gradient) | None)."""
    uf = _pre_activation(f, bias).to(_math_dtype(f))
    cdf = 0.5 * (1.0 + torch.erf(uf * 0.7071067811865476))
    pdf = torch.exp(-0.5 * uf * uf) * 0.3989422804014327
    du = (dg.to(uf.dtype) * (cdf + uf * pdf)).to(dg.dtype)
    return du, (_column_sums(du, du.dtype) if want_bias else None)


def _column_sums(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).to(_math_dtype(t)).sum(dim=0).to(dtype)


def residual_norm(x: torch.Tensor, bias: torch.Tensor | None, res: torch.Tensor | None, keep: torch.Tensor | None,
                  drop_scale: float, gamma: torch.Tensor | None, beta: torch.Tensor | None, eps: float,
                  want_r: bool):
    """r = dropout(x + bias) + res; with gamma, y = LayerNorm(r). Returns (r | None, y, mean, rstd)."""
    md = _math_dtype(x)
    v = x.to(md)
    if bias is not None:
        v = v + bias.to(md)
    if keep is not None:
        v = v * keep.to(md) * drop_scale
    if res is not None:
        v = v + res.to(md)
    r = v.to(x.dtype)
    if gamma is None:
        return r, None, None, None
    rf = r.to(md)
    mean = rf.mean(dim=-1)
    var = ((rf - mean[:, None]) ** 2).mean(dim=-1)
    rstd = torch.rsqrt(var + eps)
    y = (rf - mean[:, None]) * rstd[:, None] * gamma.to(md)
    if beta is not None:
        y = y + beta.to(md)
    return (r if want_r else None), y.to(x.dtype), mean, rstd


def norm_backward(dy: torch.Tensor, src: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor | None,
                  mean: torch.Tensor | None, rstd: torch.Tensor, invertible: bool, extra: torch.Tensor | None,
                  keep: torch.Tensor | None = None, drop_scale: float = 1.0, want_bias: bool = False):
    """LayerNorm backward from the input (src = r) or, invertible, from the output (src = y), + extra.
    Returns (dx, dgamma, dbeta, dxd, dbias | None): dxd = dx * keep * drop_scale (dx without keep),
    dbias = dxd's column sums."""
    md = _math_dtype(dy)
    g32, s32, d32 = gamma.to(md), src.to(md), dy.to(md)
    if invertible:
        xhat = (s32 - (0 if beta is None else beta.to(md))) / g32
    else:
        xhat = (s32 - mean[:, None].to(md)) * rstd[:, None].to(md)
    g = d32 * g32
    dx = rstd[:, None].to(md) * (g - g.mean(dim=-1, keepdim=True) - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    if extra is not None:
        dx = dx + extra.to(md)
    dx = dx.to(dy.dtype)
    dxd = dx if keep is None else (dx.to(md) * keep.to(md) * drop_scale).to(dy.dtype)
    return (dx, (d32 * xhat).sum(dim=0).to(gamma.dtype), d32.sum(dim=0).to(gamma.dtype), dxd,
            _column_sums(dxd, gamma.dtype) if want_bias else None)


def softmax(scores: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(scale * s + mask) over [B, heads, Sq, Sk]; mask [B, 1 | Sq, Sk] (math dtype)."""
    md = _math_dtype(scores)
    s = scores.to(md) * scale
    if mask is not None:
        s = s + mask.to(md)[:, None]
    return torch.softmax(s, dim=-1).to(scores.dtype)


def softmax_backward(dp: torch.Tensor, p: torch.Tensor, scale: float) -> torch.Tensor:
    md = _math_dtype(dp)
    p32, d32 = p.to(md), dp.to(md)
    return (scale * p32 * (d32 - (p32 * d32).sum(dim=-1, keepdim=True))).to(dp.dtype)


def stack_qkv_grad(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([dq | dk | dv] by rows, its column sums)."""
    out = torch.cat([dq, dk, dv], dim=1)
    return out, out.sum(dim=0)
