"""A small layer list for the pipeline tests (tied input/output projection, Linear/Tanh body) and
its single-process reference training in float64-free plain PyTorch (same layers, same seeds)."""
from __future__ import annotations

import numpy as np
import torch

IN, H, GAS, MBS = 6, 8, 4, 3


def tied_out(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight  # the input projection's weight, transposed use


def specs():
    from deepspeed_c.pipe import LayerSpec, TiedLayerSpec

    return [TiedLayerSpec("embed", torch.nn.Linear, IN, H, bias=False),
            LayerSpec(torch.nn.Linear, H, H), LayerSpec(torch.nn.Tanh),
            LayerSpec(torch.nn.Linear, H, H), LayerSpec(torch.nn.Tanh),
            LayerSpec(torch.nn.Linear, H, H), LayerSpec(torch.nn.Tanh),
            TiedLayerSpec("embed", torch.nn.Linear, IN, H, bias=False, forward_fn=tied_out)]


def batches(steps: int, dp: int) -> list:
    """[step][dp * GAS] micro-batches (x, y); replica d takes [d * GAS:(d + 1) * GAS]."""
    g = torch.Generator().manual_seed(7)
    return [[(torch.randn(MBS, IN, generator=g), torch.randn(MBS, IN, generator=g)) for _ in range(dp * GAS)]
            for _ in range(steps)]


def reference(steps: int, dp: int, lr: float, clip: float) -> tuple[list, dict]:
    """Losses per step and final weights (by 'layer_idx.name') of single-process training."""
    layers, tied = [], None
    for i, s in enumerate(specs()):
        torch.manual_seed(1234 + i)
        if hasattr(s, "key"):
            if tied is None:
                tied = s.build()
            layers.append(tied if s.forward_fn is None else (lambda x, m=tied, f=s.forward_fn: f(m, x)))
        else:
            layers.append(s.build())
    params = list(tied.parameters()) + [p for l in layers if isinstance(l, torch.nn.Module) and l is not tied
                                        for p in l.parameters()]
    opt = torch.optim.Adam(params, lr=lr)
    losses = []
    for step in batches(steps, dp):
        opt.zero_grad()
        total = 0.0
        for x, y in step:
            h = x
            for l in layers:
                h = l(h)
            loss = torch.nn.functional.mse_loss(h, y)
            (loss / len(step)).backward()
            total += loss.item()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        losses.append(total / len(step))
    weights = {}
    for i, l in enumerate(layers):
        if isinstance(l, torch.nn.Module):
            for n, p in l.named_parameters():
                weights[f"{i}.{n}"] = p.detach().numpy().copy()
    return losses, weights
