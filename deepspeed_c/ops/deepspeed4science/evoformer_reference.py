"""The torch path of Evoformer attention, used on the host (and for float32/float64 on a GPU):
the same flash-style algorithm as csrc/cuda/evoformer_{fwd,bwd}.cu, over query chunks instead of
register tiles, so at most `chunk x L` scores per (b, n, h) exist at once. Math runs in float32
for half inputs (float64 stays float64). The backward recomputes the probabilities from the
saved log-sum-exp, as the kernel does.

Shapes: q, k, v [B, N, L, H, D]; bias1 [B, N, 1, 1, L]; bias2 [B, 1, H, L, L]; lse [B, N, H, L]."""
from __future__ import annotations

import torch

# Query rows per chunk: bounds the live scores at B * N * H * chunk * L elements.
DEFAULT_CHUNK = 64


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _heads_first(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).permute(0, 1, 3, 2, 4)  # [B, N, H, L, D]


def _scores(qh: torch.Tensor, kh: torch.Tensor, bias1: torch.Tensor | None, bias2: torch.Tensor | None,
            lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """Scores of query rows lo:hi, [B, N, H, hi - lo, L] (qh already scaled)."""
    s = torch.matmul(qh[..., lo:hi, :], kh.transpose(-1, -2))
    if bias1 is not None:
        s = s + bias1.to(dtype)  # [B, N, 1, 1, L]
    if bias2 is not None:
        s = s + bias2[..., lo:hi, :].to(dtype)  # [B, 1, H, c, L]
    return s


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias1: torch.Tensor | None,
            bias2: torch.Tensor | None, scale: float, chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o in q's dtype, lse [B, N, H, L] in the compute dtype). A row with every score
    -inf gets o = 0 and lse = +inf."""
    dt = _compute_dtype(q)
    qh, kh, vh = _heads_first(q, dt) * scale, _heads_first(k, dt), _heads_first(v, dt)
    L = q.shape[2]
    out = torch.empty_like(qh)
    lse = torch.empty(qh.shape[:-1], dtype=dt, device=q.device)
    for lo in range(0, L, chunk):
        hi = min(L, lo + chunk)
        s = _scores(qh, kh, bias1, bias2, lo, hi, dt)
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        l = p.sum(dim=-1, keepdim=True)
        out[..., lo:hi, :] = torch.matmul(p, vh) / torch.where(l > 0, l, torch.ones_like(l))
        lse[..., lo:hi] = torch.where(l[..., 0] > 0, m[..., 0] + torch.log(l[..., 0]),
                                      torch.full_like(l[..., 0], float("inf")))
    return out.permute(0, 1, 3, 2, 4).to(q.dtype).contiguous(), lse


def backward(d_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
             lse: torch.Tensor, bias1: torch.Tensor | None, bias2: torch.Tensor | None, scale: float,
             want_bias1: bool, want_bias2: bool, chunk: int = DEFAULT_CHUNK):
    """Returns (dq, dk, dv, dbias1 | None, dbias2 | None), each in its input's dtype."""
    dt = _compute_dtype(q)
    qh, kh, vh = _heads_first(q, dt) * scale, _heads_first(k, dt), _heads_first(v, dt)
    doh, oh = _heads_first(d_o, dt), _heads_first(o, dt)
    delta = (doh * oh).sum(dim=-1)  # [B, N, H, L]
    L = q.shape[2]
    dq, dk, dv = torch.zeros_like(qh), torch.zeros_like(kh), torch.zeros_like(vh)
    db1 = torch.zeros(bias1.shape, dtype=dt, device=q.device) if want_bias1 else None
    db2 = torch.zeros(bias2.shape, dtype=dt, device=q.device) if want_bias2 else None
    for lo in range(0, L, chunk):
        hi = min(L, lo + chunk)
        s = _scores(qh, kh, bias1, bias2, lo, hi, dt)
        p = torch.exp(s - lse[..., lo:hi, None])  # lse = +inf gives p = 0
        dv += torch.matmul(p.transpose(-1, -2), doh[..., lo:hi, :])
        dp = torch.matmul(doh[..., lo:hi, :], vh.transpose(-1, -2))
        ds = p * (dp - delta[..., lo:hi, None])
        dq[..., lo:hi, :] = torch.matmul(ds, kh) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qh[..., lo:hi, :])  # qh holds scale * q
        if db1 is not None:
            db1 += ds.sum(dim=(2, 3), keepdim=True)
        if db2 is not None:
            db2[..., lo:hi, :] += ds.sum(dim=1, keepdim=True)

    def back(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return t.permute(0, 1, 3, 2, 4).to(like.dtype).contiguous()

    return (back(dq, q), back(dk, k), back(dv, v), None if db1 is None else db1.to(bias1.dtype),
            None if db2 is None else db2.to(bias2.dtype))
