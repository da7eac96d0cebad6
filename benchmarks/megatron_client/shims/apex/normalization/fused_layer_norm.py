"""apex.normalization.fused_layer_norm stand-ins: torch's layer norm under apex's names."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class FusedLayerNormAffineFunction:
    """apex's autograd Function's call shape, apply(input, weight, bias, normalized_shape, eps), as
    F.layer_norm (autograd differentiates it); forward has apex's argument names, which Megatron inspects."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps):  # noqa: A002 - apex's argument names
        return F.layer_norm(input, tuple(normalized_shape), weight, bias, eps)

    @staticmethod
    def apply(input, weight, bias, normalized_shape, eps):  # noqa: A002
        return F.layer_norm(input, tuple(normalized_shape), weight, bias, eps)


class MixedFusedLayerNorm(torch.nn.LayerNorm):
    def __init__(self, normalized_shape, eps: float = 1e-5, **_: object) -> None:
        super().__init__(normalized_shape, eps=eps)
