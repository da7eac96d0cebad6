"""A small layer list for the pipeline tests (optionally a tied input/output projection, a
Linear/Tanh body) and its single-process reference training in plain PyTorch with the same layers
and seeds: fp32, or bf16 emulated as the engine's stage-0 bf16 optimizer does it (bf16 model,
gradients accumulated in bf16 across micro-batches, fp32 masters stepped by torch Adam)."""
from __future__ import annotations

import copy

import torch

IN, H, GAS, MBS = 6, 8, 4, 3


def tied_out(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight  # the input projection's weight, transposed use


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), y)  # fp32 loss of a bf16 model, as a user writes it


def specs(tied: bool = True) -> list:
    from deepspeed_c.pipe import LayerSpec, TiedLayerSpec

    first = TiedLayerSpec("embed", torch.nn.Linear, IN, H, bias=False) if tied else \
        LayerSpec(torch.nn.Linear, IN, H, bias=False)
    last = TiedLayerSpec("embed", torch.nn.Linear, IN, H, bias=False, forward_fn=tied_out) if tied else \
        LayerSpec(torch.nn.Linear, H, IN)
    return [first, LayerSpec(torch.nn.Linear, H, H), LayerSpec(torch.nn.Tanh),
            LayerSpec(torch.nn.Linear, H, H), LayerSpec(torch.nn.Tanh),
            LayerSpec(torch.nn.Linear, H, H), LayerSpec(torch.nn.Tanh), last]


def batches(steps: int, dp: int, gas: int = GAS) -> list:
    """[step][dp * gas] micro-batches (x, y); replica d takes [d * gas:(d + 1) * gas]."""
    g = torch.Generator().manual_seed(7)
    return [[(torch.randn(MBS, IN, generator=g), torch.randn(MBS, IN, generator=g)) for _ in range(dp * gas)]
            for _ in range(steps)]


def reference(steps: int, dp: int, lr: float, clip: float, gas: int = GAS, tied: bool = True,
              bf16: bool = False, accum32: bool = False, sgd: bool = False) -> tuple[list, dict]:
    """Losses per step and final weights (by 'layer_idx.name', as float32) of single-process training."""
    layers, tied_mod = [], None
    for i, s in enumerate(specs(tied)):
        torch.manual_seed(1234 + i)
        if hasattr(s, "key"):
            if tied_mod is None:
                tied_mod = s.build()
            layers.append(tied_mod if s.forward_fn is None else (lambda x, m=tied_mod, f=s.forward_fn: f(m, x)))
        else:
            layers.append(s.build())
    modules = []
    for l in layers:
        if isinstance(l, torch.nn.Module) and all(l is not m for m in modules):
            modules.append(l)
    masters = [p for m in modules for p in m.parameters()]
    if bf16:
        lp_modules = [copy.deepcopy(m).to(torch.bfloat16) for m in modules]
        swap = {id(m): lp for m, lp in zip(modules, lp_modules)}
        run_layers = [swap.get(id(l), l) if isinstance(l, torch.nn.Module) else
                      (lambda x, m=swap[id(tied_mod)], f=tied_out: f(m, x)) for l in layers]
        lp_params = [p for m in lp_modules for p in m.parameters()]
    else:
        run_layers, lp_params = layers, masters
    opt = torch.optim.SGD(masters, lr=lr) if sgd else torch.optim.Adam(masters, lr=lr)
    losses = []
    for step in batches(steps, dp, gas):
        opt.zero_grad()
        for p in lp_params:
            p.grad = None
        total = 0.0
        for x, y in step:
            h = x.to(torch.bfloat16) if bf16 else x
            for l in run_layers:
                h = l(h)
            loss = loss_fn(h, y)
            (loss / len(step)).backward()
            total += loss.item()
            if accum32:  # each micro-batch's bf16 gradient folded into an fp32 accumulator
                for m, p in zip(masters, lp_params):
                    m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
                    p.grad = None
        if bf16 and not accum32:
            for m, p in zip(masters, lp_params):
                m.grad = p.grad.float()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        opt.step()
        if bf16:
            with torch.no_grad():
                for m, p in zip(masters, lp_params):
                    p.copy_(m)
        losses.append(total / len(step))
    weights = {}
    for i, l in enumerate(run_layers):
        if isinstance(l, torch.nn.Module):
            for n, p in l.named_parameters():
                weights[f"{i}.{n}"] = p.detach().float().numpy().copy()
    return losses, weights


class Split(torch.nn.Module):
    """Emits a tuple with an integer tensor: (h, mask) crosses the stage boundary."""

    def forward(self, h: torch.Tensor) -> tuple:
        return (h.detach() > -10).to(torch.int64), torch.tanh(h)  # the integer tensor first


class Merge(torch.nn.Module):
    def forward(self, pair: tuple) -> torch.Tensor:
        mask, h = pair
        return h * mask.to(h.dtype)


def tuple_specs() -> list:
    from deepspeed_c.pipe import LayerSpec

    return [LayerSpec(torch.nn.Linear, IN, H), LayerSpec(Split), LayerSpec(Merge), LayerSpec(torch.nn.Linear, H, IN)]


def varying_batches(steps: int) -> list:
    """Micro-batch sizes change from step to step (dynamic_shape)."""
    g = torch.Generator().manual_seed(11)
    return [[(torch.randn(2 + (s + j) % 3, IN, generator=g), torch.randn(2 + (s + j) % 3, IN, generator=g))
             for j in range(GAS)] for s in range(steps)]


def tuple_reference(steps: int, lr: float) -> list:
    layers = []
    for i, s in enumerate(tuple_specs()):
        torch.manual_seed(1234 + i)
        layers.append(s.build())
    params = [p for l in layers for p in l.parameters()]
    opt = torch.optim.Adam(params, lr=lr)
    losses = []
    for step in varying_batches(steps):
        opt.zero_grad()
        total = 0.0
        for x, y in step:
            h = x
            for l in layers:
                h = l(h)
            loss = loss_fn(h, y)
            (loss / len(step)).backward()
            total += loss.item()
        opt.step()
        losses.append(total / len(step))
    return losses
