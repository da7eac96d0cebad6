"""apex.normalization.fused_layer_norm stand-ins: torch's layer norm under apex's names."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class FusedLayerNormAffineFunction(torch.autograd.Function):
    """apply(input, weight, bias, normalized_shape, eps): F.layer_norm, gradients by autograd."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps):  # noqa: A002 - apex's argument names
        with torch.enable_grad():
            x = input.detach().requires_grad_(input.requires_grad)
            w = weight.detach().requires_grad_(weight.requires_grad)
            b = bias.detach().requires_grad_(bias.requires_grad)
            out = F.layer_norm(x, tuple(normalized_shape), w, b, eps)
        ctx.save_for_backward(x, w, b, out)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        x, w, b, out = ctx.saved_tensors
        inputs = [t for t in (x, w, b) if t.requires_grad]
        grads = iter(torch.autograd.grad(out, inputs, grad)) if inputs else iter(())
        return (next(grads) if x.requires_grad else None, next(grads) if w.requires_grad else None,
                next(grads) if b.requires_grad else None, None, None)


class MixedFusedLayerNorm(torch.nn.LayerNorm):
    def __init__(self, normalized_shape, eps: float = 1e-5, **_: object) -> None:
        super().__init__(normalized_shape, eps=eps)
