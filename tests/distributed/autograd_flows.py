"""The ways users call autograd around a DeepSpeed engine, written once and run two ways: on real ranks
through the engine, and in one process on plain PyTorch (float64) as the reference.

A flow is one micro-batch of one rank: `flow(trainer, x, y) -> list of observed tensors` (gradients the
user reads back: input saliencies, per-sample gradients, a captured weight gradient). A trainer is either
the engine (`EngineTrainer`: `backward` is `engine.backward`, `direct_backward` is a plain `loss.backward()`
that the engine scales by gradient_accumulation_steps) or the reference (`ReferenceTrainer`: every loss of
rank r is divided by world * gas and backpropagated, so after all ranks' micro-batches `.grad` holds what
the engine's reduction averages; then the same SGD step).

The flows (each a user pattern named after the method it comes from):
- fgsm: `autograd.grad(loss, x)` for an adversarial input, then the real backward on x + eps * sign(gx)
- inputs_first: `torch.autograd.backward(loss, inputs=[x], retain_graph=True)`, then `engine.backward(loss)`
- grad_wrt_weight: `autograd.grad(loss, weight, retain_graph=True)` read back (GradNorm-style logging)
  before the backward; with a direct `loss.backward()` under accumulation
- gradnorm_penalty: `autograd.grad(loss, weight, create_graph=True)`, its norm added to the loss
- input_penalty: WGAN-GP / R1, `autograd.grad(out.sum(), x, create_graph=True)` penalised
- two_losses: two heads of one forward, `engine.backward(a, retain_graph=True)` then `engine.backward(b)`
- per_sample: `torch.func.vmap(torch.func.grad(...functional_call...))` per-sample gradients, then a step
- energy_force: a force field, forces = -dE/dx (create_graph inside the forward) trained on forces"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

D_IN, HIDDEN, D_OUT = 6, 12, 3
MICRO = 4  # samples per rank and micro-batch
EPS = 0.05
LAM = 0.3
LR = 0.2


class Net(torch.nn.Module):
    """Embedding, a frozen layer, a block under non-reentrant activation checkpointing, two heads."""

    def __init__(self, ckpt: bool = True) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.embed = torch.nn.Linear(D_IN, HIDDEN)
        self.frozen = torch.nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)
        self.body = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, D_OUT)
        self.aux = torch.nn.Linear(HIDDEN, 1, bias=False)

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(h))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.frozen(h))
        if self.ckpt and torch.is_grad_enabled():
            h = torch.utils.checkpoint.checkpoint(self._block, h, use_reentrant=False)
        else:
            h = self._block(h)
        return self.head(h), self.aux(h)


def make_model(kind: str) -> torch.nn.Module:
    """The flow's model, seeded: "net" (Net), "net_plain" (Net without checkpointing: create_graph through
    torch's checkpoint recomputes twice but is exact; kept apart so a failure names the cause), or "lora"
    (PEFT LoRA on body and head of a Net)."""
    torch.manual_seed(1234)
    if kind == "lora":
        import peft

        cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["body", "head"], lora_dropout=0.0,
                              init_lora_weights=False)
        return peft.get_peft_model(Net(ckpt=False), cfg)
    return Net(ckpt=kind == "net")


def mse(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out[0] if isinstance(out, tuple) else out, y)


# -- the flows ------------------------------------------------------------------------------------------
def plain(tr: Any, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    tr.backward(mse(tr(x), y))
    return []


def fgsm(tr: Any, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_(True)
    gx, = torch.autograd.grad(mse(tr(x), y), x)
    x_adv = (x + EPS * gx.sign()).detach()
    tr.backward(mse(tr(x_adv), y))
    return [gx]


def inputs_first(tr: Any, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_(True)
    loss = mse(tr(x), y)
    torch.autograd.backward(loss, inputs=[x], retain_graph=True)
    saliency = x.grad.clone()
    tr.backward(loss)
    return [saliency]


def grad_wrt_weight(tr: Any, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    loss = mse(tr(x), y)
    gw, = torch.autograd.grad(loss, tr.module.body.weight, retain_graph=True)  # at ZeRO-3 too: no gather needed
    gw = gw.clone()
    tr.direct_backward(loss)
    return [gw]


def gradnorm_penalty(tr: Any, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    out = tr(x)
    loss = mse(out, y)
    gw, = torch.autograd.grad(loss, tr.module.head.weight, create_graph=True)
    tr.backward(loss + LAM * gw.pow(2).sum())
    return [gw.detach()]


def input_penalty(tr: Any, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out, aux = tr(x)
    gx, = torch.autograd.grad(aux.sum(), x, create_graph=True)
    penalty = (gx.norm(2, dim=1) - 1).pow(2).mean()
    tr.backward(mse(out, y) + LAM * penalty)
    return [gx.detach()]


def two_losses(tr: Any, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    out, aux = tr(x)
    tr.backward(mse(out, y), retain_graph=True)
    tr.backward(aux.pow(2).mean())
    return []


def per_sample(tr: Any, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    from torch.func import functional_call, grad, vmap

    module = tr.module
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    with tr.gathered(list(module.parameters())):
        params = {n: p.detach().clone() for n, p in module.named_parameters()}

        def one(ps: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            return mse(functional_call(module, ps, (xi[None],)), yi[None])

        grads = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    tr.backward(mse(tr(x), y))
    return [grads[n] for n in names]


def energy_force(tr: Any, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    pos = x.clone().requires_grad_(True)
    out, energy = tr(pos)
    forces, = torch.autograd.grad(energy.sum(), pos, create_graph=True)
    target = y[:, :1].expand(-1, D_IN)
    tr.backward(F.mse_loss(-forces, target) + 0.1 * mse(out, y))
    return [forces.detach()]


FLOWS: dict[str, tuple[Callable, str, int]] = {
    # name: (flow, model kind, gradient accumulation steps)
    "plain": (plain, "net", 1),
    "plain_gas2": (plain, "net_plain", 2),
    "fgsm": (fgsm, "net", 1),
    "fgsm_gas2": (fgsm, "net", 2),
    "inputs_first": (inputs_first, "net", 2),
    "grad_wrt_weight": (grad_wrt_weight, "net", 2),
    "gradnorm_penalty": (gradnorm_penalty, "net_plain", 1),
    "input_penalty": (input_penalty, "net_plain", 1),
    "input_penalty_ckpt": (input_penalty, "net", 2),
    "two_losses": (two_losses, "net", 1),
    "per_sample": (per_sample, "net_plain", 1),
    "energy_force": (energy_force, "net_plain", 1),
    "lora_fgsm": (fgsm, "lora", 2),
}


# -- trainers -------------------------------------------------------------------------------------------
class EngineTrainer:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.module = engine.module
        if hasattr(self.module, "base_model"):  # PEFT: flows address the Net's layers
            self.module = self.module.base_model.model

    def __call__(self, x: torch.Tensor) -> Any:
        return self.engine(x)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        self.engine.backward(loss, retain_graph=retain_graph)

    def direct_backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def gathered(self, params: list) -> Any:
        import deepspeed_c

        return deepspeed_c.zero.GatheredParameters(params)

    def step(self) -> None:
        self.engine.step()


class ReferenceTrainer:
    """Plain PyTorch on one process; `scale` = 1 / (world * gas) turns per-rank losses into the engine's
    averaged gradients."""

    def __init__(self, model: torch.nn.Module, scale: float) -> None:
        self.model = model
        self.module = model.base_model.model if hasattr(model, "base_model") else model
        self.scale = scale
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.SGD(params, lr=LR)

    def __call__(self, x: torch.Tensor) -> Any:
        return self.model(x.double())

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        (loss * self.scale).backward(retain_graph=retain_graph)

    def direct_backward(self, loss: torch.Tensor) -> None:
        self.backward(loss)

    @contextlib.contextmanager
    def gathered(self, params: list) -> Iterator[None]:
        yield

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def data(world: int, gas: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y of shape (steps, gas, world, MICRO, ...)."""
    g = torch.Generator().manual_seed(99)
    x = torch.randn(steps, gas, world, MICRO, D_IN, generator=g)
    y = torch.randn(steps, gas, world, MICRO, D_OUT, generator=g)
    return x, y


def trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().double().cpu().clone() for n, p in module.named_parameters() if p.requires_grad}


def reference_run(name: str, world: int, steps: int) -> tuple[dict[str, torch.Tensor], list[list[torch.Tensor]]]:
    """(final trainable weights, observations[rank] flattened over steps and micro-batches) in float64."""
    flow, kind, gas = FLOWS[name]
    model = make_model(kind).double()
    tr = ReferenceTrainer(model, 1.0 / (world * gas))
    x, y = data(world, gas, steps)
    obs: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for s in range(steps):
        for m in range(gas):
            for r in range(world):
                obs[r] += [o.detach().clone() for o in flow(tr, x[s, m, r].double(), y[s, m, r].double())]
        tr.step()
    return trainable_state(model), obs
