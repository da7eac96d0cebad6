"""DeepSpeed 0.19.8's `deepspeed.runtime.zero.muon.original_muon` names: the Newton-Schulz functions, the
per-tensor Muon and Adam updates, and the Muon optimizer classes (here all one implementation,
muon_optimizer.MuonWithAuxAdam, which steps whole tensors or a ZeRO partition alike)."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from deepspeed_c.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed_c.runtime.zero.muon.newton_schulz import (NS_METHODS, aspect_scale, matrix_view_shape,
                                                         orthogonalize_stack)

__all__ = ["NS_METHODS", "zeropower_via_newtonschulz5", "zeropower_via_gram_newtonschulz", "muon_update",
           "adam_update", "Muon", "SingleDeviceMuon", "MuonWithAuxAdam", "SingleDeviceMuonWithAuxAdam"]


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int) -> torch.Tensor:
    """The standard iteration on G (..., rows, cols), in its compute dtype (bf16 on a GPU, fp32 on the host)."""
    return orthogonalize_stack(G, steps, "standard")


def zeropower_via_gram_newtonschulz(G: torch.Tensor, steps: int) -> torch.Tensor:
    """The Gram-matrix iteration on G (..., rows, cols), in its compute dtype (fp16 on a GPU, fp32 on the host)."""
    return orthogonalize_stack(G, steps, "gram")


@torch.no_grad()
def muon_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float = 0.95, ns_steps: int = 5,
                nesterov: bool = True, ns_method: str = "gram", is_expert_group: bool = False) -> torch.Tensor:
    """One tensor's Muon update in grad's dtype: momentum updated in place, the Nesterov blend (or the momentum)
    orthogonalised and scaled by sqrt(max(1, rows / cols)) of grad's last two dims."""
    momentum.lerp_(grad, 1.0 - beta)
    blended = grad.lerp(momentum, beta) if nesterov else momentum
    view = matrix_view_shape(tuple(grad.shape), is_expert_group)
    ortho = orthogonalize_stack(blended.reshape(view), ns_steps, ns_method)
    return (ortho.to(grad.dtype) * aspect_scale(tuple(grad.shape))).reshape(view)


@torch.no_grad()
def adam_update(grad: torch.Tensor, buf1: torch.Tensor, buf2: torch.Tensor, step: int, betas: Sequence[float],
                eps: float) -> torch.Tensor:
    """Adam's bias-corrected direction (moments updated in place; eps outside the square root)."""
    buf1.lerp_(grad, 1.0 - betas[0])
    buf2.lerp_(grad.square(), 1.0 - betas[1])
    return (buf1 / (1.0 - betas[0] ** step)) / ((buf2 / (1.0 - betas[1] ** step)).sqrt() + eps)


class SingleDeviceMuonWithAuxAdam(MuonWithAuxAdam):
    """The non-distributed variant: the same optimizer (it never needs a collective over whole tensors)."""


def _muon_groups(params: Any, lr: float, weight_decay: float, momentum: float, ns_method: str) -> list[dict]:
    params = list(params)
    if params and isinstance(params[0], dict):
        return [dict(g, use_muon=True) for g in params]
    return [dict(params=params, lr=lr, weight_decay=weight_decay, momentum=momentum, ns_method=ns_method,
                 use_muon=True)]


class Muon(MuonWithAuxAdam):
    """Muon alone, over matrices only (hidden weights; embeddings, heads and gains go to another optimizer)."""

    def __init__(self, params: Any, lr: float = 0.02, weight_decay: float = 0, momentum: float = 0.95,
                 ns_method: str = "gram") -> None:
        super().__init__(_muon_groups(params, lr, weight_decay, momentum, ns_method))


class SingleDeviceMuon(Muon):
    """The non-distributed variant of Muon (the same optimizer)."""
