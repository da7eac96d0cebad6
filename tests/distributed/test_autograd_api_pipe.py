"""The pipeline column of the autograd matrix (tests/distributed/test_autograd_api_matrix.py): layers that call
autograd themselves inside a PipelineEngine, 2 stages on 2 gloo ranks, schedules 1F1B and ZB-H1 (whose B pass
defers Linear weight gradients through runtime/linear_weight_sink.py), ZeRO 0 and 1, against single-process
float64 PyTorch with the same layers and seeds.

- ForceLayer: a force field's layer, `autograd.grad(energy, x, create_graph=True)` inside forward, trained
  through the second-order graph (the sink must not be asked under create_graph).
- VmapLayer: `torch.func.vmap` over a Linear inside forward (the sink's autograd.Function cannot run under
  functorch; the layer must see torch's Linear). Before the rule this raised "must override the setup_context
  staticmethod" at every ZB-H1 stage."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.distributed.test_pipe_parity import _layer_weights
from tests.harness import run_distributed

IN, H, MBS, GAS, STEPS, LR = 5, 7, 3, 2, 2, 0.1
TOL = 1e-5


class ForceLayer(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.energy = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            e = torch.tanh(self.energy(x)).pow(2).sum()
            force, = torch.autograd.grad(e, x, create_graph=True)
        return x - 0.1 * force


class VmapLayer(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.func.vmap(self.lin)(x))


def specs() -> list:
    from deepspeed_c.pipe import LayerSpec

    return [LayerSpec(torch.nn.Linear, IN, H), LayerSpec(ForceLayer, H), LayerSpec(torch.nn.Tanh),
            LayerSpec(VmapLayer, H), LayerSpec(torch.nn.Linear, H, H), LayerSpec(torch.nn.Linear, H, IN)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, y)


def batches() -> list:
    g = torch.Generator().manual_seed(5)
    return [[(torch.randn(MBS, IN, generator=g), torch.randn(MBS, IN, generator=g)) for _ in range(GAS)]
            for _ in range(STEPS)]


def reference() -> dict[str, np.ndarray]:
    layers = []
    for i, s in enumerate(specs()):
        torch.manual_seed(1234 + i)
        layers.append(s.build().double())
    params = [p for m in layers for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    for step in batches():
        opt.zero_grad()
        for x, y in step:
            h = x.double().requires_grad_(False)
            for m in layers:
                h = m(h)
            (loss_fn(h, y.double()) / GAS).backward()
        opt.step()
    return {f"{i}.{n}": p.detach().numpy().copy() for i, m in enumerate(layers) for n, p in m.named_parameters()}


def body(rank: int, world: int, schedule: str, zero: int) -> dict[str, Any]:
    import deepspeed_c as deepspeed
    from deepspeed_c.pipe import PipelineModule

    model = PipelineModule(specs(), num_stages=2, loss_fn=loss_fn, seed_layers=True, partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": zero}, "zero_allow_untested_optimizer": True,
           "pipeline": {"schedule": schedule}, "steps_per_print": 10 ** 6}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
    for step in batches():
        engine.train_batch(iter(step))
    return {k: v.astype(np.float64) for k, v in _layer_weights(model).items()}


@pytest.mark.parametrize("schedule,zero", [("1f1b", 0), ("zb_h1", 0), ("zb_h1", 1)])
def test_pipeline_layers_calling_autograd(schedule: str, zero: int) -> None:
    ranks = run_distributed(body, world_size=2, args=(schedule, zero), timeout=300)
    got = {k: v for r in ranks for k, v in r.items()}
    ref = reference()
    assert set(got) == set(ref)
    errs = {k: float(np.linalg.norm(got[k] - ref[k]) / np.linalg.norm(ref[k])) for k in ref}
    assert max(errs.values()) < TOL, errs
    # the run trained: the weights moved from their initial values by far more than the tolerance
    torch.manual_seed(1234 + 4)
    init = specs()[4].build().weight.detach().double().numpy()
    assert np.linalg.norm(ref["4.weight"] - init) / np.linalg.norm(init) > 100 * TOL
