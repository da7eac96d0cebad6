"""A stage-0 checkpoint keeps the gradient reducer's re-planned bucket order, so a resumed run reduces its
first steps exactly as the run that saved it (runtime/checkpointing/reducer_order.py).

The model registers its parameters in another order than their gradients arrive (heads before the body),
so the reducer re-plans after its first backward; where an element sits in a bucket decides the order a
4-rank ring all-reduce sums it in. Two outputs (two heads, one loss each), the body under activation
checkpointing, gradient accumulation 2, fp32 on 4 gloo ranks: the weights after resuming equal the
uninterrupted run's bit for bit (a fresh engine reducing with the registration-order layout does not)."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tests.harness import rank_device, run_distributed

WORLD, MICRO, WIDTH = 4, 3, 24


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.head_a = torch.nn.Linear(WIDTH, 5)  # registered first, their gradients arrive first
        self.head_b = torch.nn.Linear(WIDTH, 3)
        self.body = torch.nn.Sequential(torch.nn.Linear(7, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        return self.head_a(h), self.head_b(h)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(8)
    return [(torch.randn(MICRO * WORLD, 7, generator=g), torch.randn(MICRO * WORLD, 5, generator=g),
             torch.randn(MICRO * WORLD, 3, generator=g)) for _ in range(8)]


def body(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    import deepspeed_c

    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}

    def run(engine: Any, batches: list) -> None:
        for x, ya, yb in batches:
            lo, hi = rank * MICRO, (rank + 1) * MICRO
            a, b = engine(x[lo:hi].to(rank_device()))
            loss = torch.nn.functional.mse_loss(a, ya[lo:hi].to(rank_device())) + \
                torch.nn.functional.mse_loss(b, yb[lo:hi].to(rank_device()))
            engine.backward(loss)
            engine.step()

    def weights(engine: Any) -> list[np.ndarray]:
        return [p.detach().cpu().numpy().copy() for p in engine.module.parameters()]

    batches = _batches()
    engine = deepspeed_c.initialize(model=TwoHeads(), config=config)[0]
    run(engine, batches[:4])
    engine.save_checkpoint(ckpt, tag="t")
    run(engine, batches[4:])
    straight = weights(engine)
    engine.destroy()
    engine = deepspeed_c.initialize(model=TwoHeads(), config=config)[0]
    engine.load_checkpoint(ckpt, tag="t")
    run(engine, batches[4:])
    resumed = weights(engine)
    engine.destroy()
    return {"straight": straight, "resumed": resumed}


def test_resumed_stage0_run_reduces_like_the_uninterrupted_one(tmp_path: Any) -> None:
    results = run_distributed(body, WORLD, args=(str(tmp_path / "ckpt"),), timeout=240)
    for res in results:
        for mine, want in zip(res["resumed"], res["straight"]):
            np.testing.assert_array_equal(mine, want)
