"""The torch reference of every fused inference kernel (csrc/cuda/inference_*.cu), one function
per kernel with the same arguments and the same in-place outputs. Math runs in float32 and each
output is rounded once to its dtype, as the kernels do. It is what injected models run on the
host, and what the GPU tests compare each kernel against."""
from __future__ import annotations

import math

import torch


def add_norm(x: torch.Tensor, y: torch.Tensor | None, bias: torch.Tensor | None, gamma: torch.Tensor,
             beta: torch.Tensor | None, eps: float, r_out: torch.Tensor | None, n_out: torch.Tensor) -> None:
    """r = x + y + bias (the new residual stream, written to r_out when given), then
    n = LayerNorm(r) * gamma + beta, or RMSNorm(r) * gamma when beta is None."""
    r = x.float()
    if y is not None:
        r = r + y.float()
    if bias is not None:
        r = r + bias.float()
    if r_out is not None:
        r_out.copy_(r)
        r = r_out.float()  # normalise the rounded residual, the value the next block reads
    if beta is None:
        n = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()
    else:
        mu = r.mean(-1, keepdim=True)
        var = (r - mu).pow(2).mean(-1, keepdim=True)
        n = (r - mu) * torch.rsqrt(var + eps) * gamma.float() + beta.float()
    n_out.copy_(n)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    # half-split pairs (i, i + rot/2), the layout of HF's rotate_half
    half = rot // 2
    x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    c1, c2 = cos[..., :half], cos[..., half:rot]
    s1, s2 = sin[..., :half], sin[..., half:rot]
    return torch.cat([x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, rest], dim=-1)


def qkv_rotary_cache(qkv: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor | None,
                     sin: torch.Tensor | None, positions: torch.Tensor | None, past: int,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, q_out: torch.Tensor,
                     n_heads: int, n_kv: int, head_dim: int, rot: int) -> None:
    """qkv [B, T, (H + 2 Hkv) D] (+ bias) split into heads; q and k rotated by the cos/sin rows
    [P, D] of their positions [B, T]; q to q_out [B, T, H, D]; k and v written into the caches
    [B, Hkv, S, D] at rows past .. past + T."""
    b, t = qkv.shape[0], qkv.shape[1]
    h = qkv.float()
    if bias is not None:
        h = h + bias.float()
    q = h[..., : n_heads * head_dim].reshape(b, t, n_heads, head_dim)
    k = h[..., n_heads * head_dim:(n_heads + n_kv) * head_dim].reshape(b, t, n_kv, head_dim)
    v = h[..., (n_heads + n_kv) * head_dim:].reshape(b, t, n_kv, head_dim)
    if cos is not None:
        pos = positions.clamp(0, cos.shape[0] - 1)
        c = cos.float()[pos].unsqueeze(2)  # [B, T, 1, D]
        s = sin.float()[pos].unsqueeze(2)
        q = _rotate(q, c, s, rot)
        k = _rotate(k, c, s, rot)
    q_out.copy_(q)
    k_cache[:, :, past:past + t].copy_(k.transpose(1, 2))
    v_cache[:, :, past:past + t].copy_(v.transpose(1, 2))


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, past: int,
              key_mask: torch.Tensor | None, scale: float, out: torch.Tensor) -> None:
    """Causal attention of q [B, T, H, D] over the cached keys 0 .. past + T: query t sees key j
    when j <= past + t and key_mask[b, j] != 0; heads share a kv head in groups of H / Hkv.
    A query row that sees no key gets zeros."""
    b, t, nh, d = q.shape
    nkv = k_cache.shape[1]
    g = nh // nkv
    kv_len = past + t
    k = k_cache[:, :, :kv_len].float().repeat_interleave(g, dim=1)  # [B, H, L, D]
    v = v_cache[:, :, :kv_len].float().repeat_interleave(g, dim=1)
    s = torch.einsum("bthd,bhjd->bhtj", q.float(), k) * scale
    allowed = torch.arange(kv_len, device=q.device)[None, :] <= (past + torch.arange(t, device=q.device))[:, None]
    allowed = allowed[None, None]
    if key_mask is not None:
        allowed = allowed & (key_mask[:, :kv_len] != 0)[:, None, None, :]
    s = s.masked_fill(~allowed, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no visible key: zeros
    out.copy_(torch.einsum("bhtj,bhjd->bthd", p, v))


def bias_gelu(h: torch.Tensor, bias: torch.Tensor | None, approximate: bool) -> None:
    """In place: h = gelu(h + bias); tanh approximation (GPT-2's gelu_new) or exact erf."""
    x = h.float()
    if bias is not None:
        x = x + bias.float()
    h.copy_(torch.nn.functional.gelu(x, approximate="tanh" if approximate else "none"))


def silu_mul(gu: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """gu [N, 2F] holds gate then up (+ bias [2F]): out [N, F] = silu(gate) * up (float32 math; float64 inputs
    keep float64)."""
    x = gu.double() if gu.dtype == torch.float64 else gu.float()
    if bias is not None:
        x = x + bias.to(x.dtype)
    f = out.shape[-1]
    out.copy_(torch.nn.functional.silu(x[..., :f]) * x[..., f:])


def moe_gemv(x: torch.Tensor, idx: torch.Tensor, wts: torch.Tensor | None, w: torch.Tensor, out: torch.Tensor,
             combine: bool) -> None:
    """idx [T, k]. expand: x [T, C] -> out [T k, N], row t k + j = x[t] . w[idx[t, j]]^T. combine: x [T k, C],
    wts float32 [T, k] -> out [T, N] = sum_j wts[t, j] x[t k + j] . w[idx[t, j]]^T, summed in float32 (float64
    for float64). An index outside [0, E) adds nothing."""
    t, k = idx.shape
    acc = torch.float64 if w.dtype == torch.float64 else torch.float32
    valid = (idx >= 0) & (idx < w.shape[0])
    sel = w[idx.clamp(0, w.shape[0] - 1).reshape(-1)].to(acc)  # [T k, N, C]
    rows = x.to(acc) if combine else x.to(acc).repeat_interleave(k, dim=0)
    y = torch.einsum("pnc,pc->pn", sel, rows) * valid.reshape(-1, 1)  # [T k, N]
    if combine:
        y = (y.view(t, k, -1) * wts.to(acc).unsqueeze(-1)).sum(dim=1)
    out.copy_(y.view(out.shape))
