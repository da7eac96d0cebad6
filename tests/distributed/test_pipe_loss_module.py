"""PipelineModule(..., loss_fn=<an nn.Module>), as DeepSpeed's pipeline tutorial passes
torch.nn.CrossEntropyLoss(): the loss module survives the layer build (and the rebuild for virtual
stages) and trains exactly like the same loss given as a plain function and like plain PyTorch
(tests/distributed/pipe_models.py's single-process reference), on 2 gloo ranks."""
from __future__ import annotations

import numpy as np
import torch

from tests.distributed import pipe_models as pm
from tests.harness import run_distributed

STEPS, LR = 3, 1e-2


class WeightedMSE(torch.nn.Module):
    """A loss module holding a buffer (like CrossEntropyLoss(weight=...)): it must follow the module."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(out, y) * self.scale


def _train(world: int, loss_fn, schedule: str = "1f1b", virtual: int = 1) -> dict:
    import deepspeed_c as deepspeed
    from deepspeed_c.pipe import PipelineModule

    model = PipelineModule(pm.specs(), num_stages=2, loss_fn=loss_fn, seed_layers=True)
    cfg = {"train_micro_batch_size_per_gpu": pm.MBS, "gradient_accumulation_steps": pm.GAS,
           "pipeline": {"schedule": schedule, "virtual_stages": virtual}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, optimizer=lambda ps: torch.optim.Adam(ps, lr=LR))
    losses = [float(engine.train_batch(iter(step))) for step in pm.batches(STEPS, 1)]
    weights = {}
    for local, f in enumerate(model.forward_funcs):
        if isinstance(f, torch.nn.Module):
            for n, p in f.named_parameters():
                weights[f"{model._layer_ids[local]}.{n}"] = p.detach().float().numpy().copy()
    return {"losses": np.array(losses), "weights": weights, "kept": model.loss_fn is loss_fn}


def _body(rank: int, world: int) -> list:
    return [_train(world, pm.loss_fn), _train(world, torch.nn.MSELoss()), _train(world, WeightedMSE()),
            _train(world, torch.nn.MSELoss(), schedule="interleaved", virtual=2)]


def test_loss_module_trains_like_the_plain_function_and_plain_pytorch():
    results = run_distributed(_body, world_size=2, timeout=240)
    want_losses, want_w = pm.reference(STEPS, 1, LR, 0.0)
    function = results[1][0]
    for case in range(4):
        got_w = {**results[0][case]["weights"], **results[1][case]["weights"]}
        for r in results:
            assert r[case]["kept"], case
            np.testing.assert_allclose(r[case]["losses"], want_losses, rtol=1e-5, atol=1e-6, err_msg=str(case))
        for key, want in want_w.items():
            if key.startswith("7."):
                continue  # the tied projection is layer 0's weight
            assert np.linalg.norm(got_w[key] - want) <= 1e-5 * np.linalg.norm(want), (case, key)
        if case in (1, 2):  # a loss module gives what the same loss as a function gives, bit for bit
            np.testing.assert_array_equal(results[1][case]["losses"], function["losses"])
