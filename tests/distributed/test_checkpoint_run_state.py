"""A checkpoint carries the training state an exact resume needs beyond weights and optimizer: each rank's
random generators and the training data loader's position (runtime/checkpointing/run_state.py).

A model with dropout is fed by the engine's own loader (`training_data`: a shuffling DistributedSampler,
dataloader workers), fp32, gradient accumulation 2; the checkpoint is taken mid-pass, in the second epoch
of the sampler (set_epoch), and training runs on past the end of the pass. A fresh engine (built after the
process's RNG has moved elsewhere) that loads the checkpoint reproduces the uninterrupted run's losses
and weights bit for bit, on 1 and 2 gloo ranks. With load_module_only the position and generators are not
restored (DeepSpeed's flag: only the weights)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.harness import run_distributed

SAMPLES, MICRO, GAS = 40, 2, 2
SAVE_AT, TOTAL = 6, 18  # micro-steps: the save mid-pass, the run past the pass's end


class DropoutNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                        torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.body(x), y)


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 6, generator=g), torch.randn(SAMPLES, 1, generator=g))


def _engine() -> tuple[Any, Any]:
    import deepspeed_c

    torch.manual_seed(11)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    engine, _, loader, _ = deepspeed_c.initialize(model=DropoutNet(), config=config, training_data=_dataset())
    return engine, loader


def _train(engine: Any, data: Any, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = next(data)
        loss = engine(x.to(engine.device), y.to(engine.device))  # on cuda:r under DSC_TEST_BACKEND=nccl
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.item()))
    return losses


def body(rank: int, world: int, ckpt: str, module_only: bool) -> dict[str, Any]:
    from deepspeed_c.runtime.dataloader import RepeatingLoader

    engine, loader = _engine()
    loader.data_sampler.set_epoch(1)  # a later epoch: its order must come back too
    data = iter(RepeatingLoader(loader))
    _train(engine, data, SAVE_AT)
    engine.save_checkpoint(ckpt, tag="mid")
    straight = _train(engine, data, TOTAL - SAVE_AT)
    weights = [p.detach().cpu().clone().numpy() for p in engine.module.parameters()]
    engine.destroy()

    torch.manual_seed(1234 + rank)  # the resuming process's generators (CPU and CUDA) are elsewhere
    engine, loader = _engine()
    engine.load_checkpoint(ckpt, tag="mid", load_module_only=module_only)
    resumed = _train(engine, iter(RepeatingLoader(loader)), TOTAL - SAVE_AT)
    resumed_weights = [p.detach().cpu().clone().numpy() for p in engine.module.parameters()]
    epoch = loader.data_sampler.epoch
    engine.destroy()
    return {"straight": straight, "resumed": resumed, "weights": weights, "resumed_weights": resumed_weights,
            "epoch": epoch}


@pytest.mark.parametrize("world", [1, 2])
def test_resume_is_bit_identical(tmp_path: Any, world: int) -> None:
    results = run_distributed(body, world, args=(str(tmp_path / "ckpt"), False), timeout=300)
    for res in results:
        assert res["epoch"] == 1
        assert res["resumed"] == res["straight"]  # exact float equality
        for a, b in zip(res["resumed_weights"], res["weights"]):
            np.testing.assert_array_equal(a, b)
    # the ranks were fed different samples (the sampler shards the data)
    if world == 2:
        assert results[0]["straight"] != results[1]["straight"]


def test_load_module_only_leaves_position_and_generators(tmp_path: Any) -> None:
    res = run_distributed(body, 1, args=(str(tmp_path / "ckpt"), True), timeout=300)[0]
    assert res["epoch"] == 0  # the fresh loader's, not the checkpoint's
    assert res["resumed"] != res["straight"]
