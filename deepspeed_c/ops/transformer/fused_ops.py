"""Front end of the transformer layer's fused pieces: tensors on a GPU go to the CUDA op
`transformer` (csrc/cuda/transformer_*.cu, built on first use), tensors on the host to the torch
forms in `fused_reference`. CUDA calls work in place where the contract allows (the pre-activation
over the GEMM output, the softmax over the scores, its backward over dP) and allocate the rest
with torch."""
from __future__ import annotations

from types import ModuleType

import torch

from deepspeed_c.ops.transformer import fused_reference as ref

_op: ModuleType | None = None
# Blocks sharing the LayerNorm backward's rows (each keeps partial gamma/beta sums).
_NORM_PARTS = 264


def cuda_op() -> ModuleType:
    global _op
    if _op is None:
        from deepspeed_c.ops.op_builder import TransformerBuilder
        _op = TransformerBuilder().load()
    return _op


def _kernel(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype in (torch.float32, torch.float16, torch.bfloat16)


def bias_gelu(f: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(u, g): u = f + bias (may reuse f's storage), g = gelu(u)."""
    if not _kernel(f):
        return ref.bias_gelu(f, bias)
    g = torch.empty_like(f)
    cuda_op().bias_gelu(f, bias, f, g)
    return f, g


def gelu(u: torch.Tensor) -> torch.Tensor:
    if not _kernel(u):
        return ref.gelu(u)
    g = torch.empty_like(u)
    cuda_op().bias_gelu(u, None, None, g)
    return g


def gelu_backward(dg: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """dg * gelu'(u), over dg's storage on a GPU."""
    if not _kernel(dg):
        return ref.gelu_backward(dg, u)
    cuda_op().gelu_backward(dg, u)
    return dg


def residual_norm(x: torch.Tensor, bias: torch.Tensor | None, res: torch.Tensor | None, keep: torch.Tensor | None,
                  drop_scale: float, gamma: torch.Tensor | None, beta: torch.Tensor | None, eps: float,
                  want_r: bool):
    """r = dropout(x + bias) + res and, with gamma, y = LayerNorm(r): (r | None, y, mean, rstd)."""
    if not _kernel(x):
        return ref.residual_norm(x, bias, res, keep, drop_scale, gamma, beta, eps, want_r)
    rows = x.numel() // x.shape[-1]
    r = torch.empty_like(x) if (want_r or gamma is None) else None
    if gamma is None:
        cuda_op().residual_norm(x, bias, res, keep, float(drop_scale), None, None, float(eps), r, None, None, None)
        return r, None, None, None
    y = torch.empty_like(x)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    cuda_op().residual_norm(x, bias, res, keep, float(drop_scale), gamma, beta, float(eps), r, y, mean, rstd)
    return r, y, mean, rstd


def norm_backward(dy: torch.Tensor, src: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor | None,
                  mean: torch.Tensor | None, rstd: torch.Tensor, invertible: bool, extra: torch.Tensor | None):
    """(dx, dgamma, dbeta) of LayerNorm, from its input or (invertible) its output; + extra."""
    if not _kernel(dy):
        return ref.norm_backward(dy, src, gamma, beta, mean, rstd, invertible, extra)
    cols = dy.shape[-1]
    parts = max(1, min(_NORM_PARTS, dy.numel() // cols))
    dx = torch.empty_like(dy)
    dgp = torch.empty(parts, cols, dtype=torch.float32, device=dy.device)
    dbp = torch.empty_like(dgp)
    cuda_op().norm_backward(dy, src, gamma, beta, mean, rstd, extra, dx, dgp, dbp, bool(invertible))
    return dx, dgp.sum(dim=0).to(gamma.dtype), dbp.sum(dim=0).to(gamma.dtype)


def softmax(scores: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(scale * scores + mask) over the last dim of [B, heads, Sq, Sk] (in place on a GPU)."""
    if not _kernel(scores):
        return ref.softmax(scores, mask, scale)
    cuda_op().softmax(scores, mask, float(scale))
    return scores


def softmax_backward(dp: torch.Tensor, p: torch.Tensor, scale: float) -> torch.Tensor:
    if not _kernel(dp):
        return ref.softmax_backward(dp, p, scale)
    cuda_op().softmax_backward(dp, p, float(scale))
    return dp
