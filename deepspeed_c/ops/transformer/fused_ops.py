"""Front end of the transformer layer's fused pieces: tensors on a GPU go to the CUDA op
`transformer` (csrc/cuda/transformer_*.cu, built on first use), tensors on the host to the torch
forms in `fused_reference`. CUDA calls work in place where the contract allows (the GELU backward
over its incoming gradient, the softmax over the scores, its backward over dP) and allocate the
rest with torch."""
from __future__ import annotations

import functools
from types import ModuleType

import torch

from deepspeed_c.ops.transformer import fused_reference as ref
from deepspeed_c.ops.transformer.philox_reference import keep_threshold

_op: ModuleType | None = None
# Column sums (gamma/beta/bias gradients) are two-stage: `parts` blocks (norm backward: a block per
# strip of rows) or row strips (gelu backward: a strip spans several blocks across the columns)
# each write float32 partial sums, `sum_parts` adds them. Per SM: enough blocks to keep the memory
# busy, few enough that the partials stay small beside the activations.
_NORM_PARTS_PER_SM = 4
_GELU_STRIPS_PER_SM = 2


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def cuda_op() -> ModuleType:
    global _op
    if _op is None:
        from deepspeed_c.ops.op_builder import TransformerBuilder
        _op = TransformerBuilder().load()
    return _op


def _kernel(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype in (torch.float32, torch.float16, torch.bfloat16)


def bias_gelu(f: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(f, g): g = gelu(u), u = f + bias rounded to f's dtype. f itself is what the backward and a
    gelu recompute take (with the same bias): u is never stored."""
    if not _kernel(f):
        return ref.bias_gelu(f, bias)
    g = torch.empty_like(f)
    cuda_op().bias_gelu(f, bias, None, g)
    return f, g


def gelu(f: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(f + bias), as bias_gelu's g."""
    if not _kernel(f):
        return ref.gelu(f, bias)
    g = torch.empty_like(f)
    cuda_op().bias_gelu(f, bias, None, g)
    return g


def gelu_backward(dg: torch.Tensor, f: torch.Tensor, bias: torch.Tensor | None = None, want_bias: bool = False):
    """(dg * gelu'(f + bias) over dg's storage on a GPU, its column sums (the bias gradient) | None)."""
    if not _kernel(dg):
        return ref.gelu_backward(dg, f, bias, want_bias)
    if not want_bias:
        cuda_op().gelu_backward(dg, f, bias, None)
        return dg, None
    cols = dg.shape[-1]
    rows = dg.numel() // cols
    parts = max(1, min(_GELU_STRIPS_PER_SM * _sm_count(dg.device.index), rows, 65535))
    part = torch.empty(1, parts, cols, dtype=torch.float32, device=dg.device)
    cuda_op().gelu_backward(dg, f, bias, part[0])
    dbias = torch.empty(cols, dtype=dg.dtype, device=dg.device)
    cuda_op().sum_parts(part, dbias)
    return dg, dbias


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
                  mean: torch.Tensor | None, rstd: torch.Tensor, invertible: bool, extra: torch.Tensor | None,
                  keep: torch.Tensor | None = None, drop_scale: float = 1.0, want_bias: bool = False):
    """LayerNorm backward from its input or (invertible) its output, + extra:
    (dx, dgamma, dbeta, dxd, dbias | None) where dxd = dx * keep * drop_scale (dx itself without
    keep: the gradient through the dropout in front of the residual add) and dbias its column sums
    (the gradient of the bias before that dropout)."""
    if not _kernel(dy):
        return ref.norm_backward(dy, src, gamma, beta, mean, rstd, invertible, extra, keep, drop_scale, want_bias)
    cols = dy.shape[-1]
    rows = dy.numel() // cols
    parts = max(1, min(_NORM_PARTS_PER_SM * _sm_count(dy.device.index), rows, 65535))
    dx = torch.empty_like(dy)
    dxd = torch.empty_like(dy) if keep is not None else None
    part = torch.empty(3 if want_bias else 2, parts, cols, dtype=torch.float32, device=dy.device)
    p = part.unbind(0)  # one call for the views (host time: the step is launch-bound at BERT sizes)
    cuda_op().norm_backward(dy, src, gamma, beta, mean, rstd, extra, keep, float(drop_scale), dx, dxd, p[0], p[1],
                            p[2] if want_bias else None, bool(invertible))
    sums = torch.empty(part.shape[0], cols, dtype=gamma.dtype, device=dy.device)
    cuda_op().sum_parts(part, sums)
    s = sums.unbind(0)
    return dx, s[0], s[1], dx if dxd is None else dxd, s[2] if want_bias else None


def stack_qkv_grad(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([dq | dk | dv] by rows as [rows, 3 * cols], its column sums (the QKV bias gradient)): one pass on a GPU."""
    if not _kernel(dq):
        return ref.stack_qkv_grad(dq, dk, dv)
    rows, cols = dq.shape
    out = torch.empty(rows, 3 * cols, dtype=dq.dtype, device=dq.device)
    parts = max(1, min(_GELU_STRIPS_PER_SM * _sm_count(dq.device.index), rows, 65535))
    part = torch.empty(1, parts, 3 * cols, dtype=torch.float32, device=dq.device)
    cuda_op().stack_qkv_grad(dq, dk, dv, out, part[0])
    dbias = torch.empty(3 * cols, dtype=dq.dtype, device=dq.device)
    cuda_op().sum_parts(part, dbias)
    return out, dbias


def _cuda_generator(device: torch.device, gen: torch.Generator | None) -> torch.Generator:
    return gen if gen is not None else torch.cuda.default_generators[device.index or 0]


def keep_mask(shape: tuple[int, ...], p: float, device: torch.device, gen: torch.Generator | None):
    """A dropout keep mask (bool, True with probability 1 - p) or None when p is 0. On a GPU the
    Philox kernel draws it from gen's seed and offset (the default CUDA generator when gen is None)
    and advances the offset, so torch's saved RNG state replays it; elsewhere, and while a CUDA
    graph is being captured, bernoulli_ draws it."""
    if p <= 0.0:
        return None
    keep = torch.empty(shape, dtype=torch.bool, device=device)
    if keep.is_cuda and not torch.cuda.is_current_stream_capturing():
        g = _cuda_generator(keep.device, gen)
        offset = g.get_offset()
        g.set_offset(offset + 4)  # torch keeps Philox offsets in multiples of 4; a call needs one distinct value
        cuda_op().dropout_keep(keep, keep_threshold(p), g.initial_seed(), offset)
        return keep
    return keep.bernoulli_(1.0 - p, generator=gen)


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
