"""apex.normalization stand-ins in plain torch."""
from __future__ import annotations

import torch

from .fused_layer_norm import FusedLayerNormAffineFunction, MixedFusedLayerNorm  # noqa: F401


class MixedFusedRMSNorm(torch.nn.Module):
    """RMSNorm with a learnt scale: x / sqrt(mean(x^2) + eps) * weight, computed in float32."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, **_: object) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(normalized_shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)
