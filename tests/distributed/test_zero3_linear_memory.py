"""ZeRO-3 releases a Linear's gathered weight after its forward even though autograd needs the weight
in the backward (zero_optimization.memory_efficient_linear, on by default as in DeepSpeed).

torch's linear saves `weight.t()`, a view of the gathered buffer, so without the memory-efficient
Linear every layer's whole weight stays alive from its forward to its backward. Checked on 2 ranks
(releases forced after each module: max_live_parameters and max_reuse_distance 0): with the default
no tensor autograd saved in the forward is a view of a released gathered buffer (the parameter
itself is saved, which ZeRO-3 points elsewhere on release); with memory_efficient_linear=false the
released buffers of the Linears whose input needs a gradient are still held that way (so the check
can fail). Training
stays equal to one process on the whole batch (fp32, AdamW, 3 steps; biased and bias-free layers,
a frozen layer, 3-d activations) with both settings."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tests.harness import rank_device, run_distributed

WIDTH, MICRO, SEQ, STEPS = 32, 2, 5, 3


def _model() -> torch.nn.Module:
    torch.manual_seed(11)
    layers = [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, WIDTH, bias=False),
              torch.nn.GELU(), torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 3)]
    model = torch.nn.Sequential(*layers)
    model[4].weight.requires_grad_(False)  # a frozen layer still gathers, still releases
    return model


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(MICRO * world, SEQ, WIDTH, generator=g), torch.randn(MICRO * world, SEQ, 3, generator=g))
            for _ in range(STEPS)]


def body(rank: int, world: int) -> dict[str, Any]:
    import deepspeed_c
    from deepspeed_c.runtime.zero.param_store import ParamStore

    released: list[tuple[int, int]] = []  # (storage pointer, bytes) of each released gathered unit
    saved: list[tuple[int, int]] = []  # the same of every non-leaf tensor autograd saved in the forward
    original = ParamStore.release

    def recording(self: ParamStore, units: Any, keep_secondary: bool = True) -> None:
        for u in units:
            full = self.full[u]
            if full is not None and not self.persistent[u] and self.pins[u] == 0:
                released.append((full.untyped_storage().data_ptr(), full.untyped_storage().nbytes()))
        original(self, units, keep_secondary)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not t.is_leaf:
            saved.append((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    ParamStore.release = recording  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    for efficient in (True, False):
        config = {"train_micro_batch_size_per_gpu": MICRO,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                        "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0,
                                        "stage3_max_live_parameters": 0, "memory_efficient_linear": efficient}}
        engine, *_ = deepspeed_c.initialize(model=_model(), config=config)
        alive_after_forward = []
        for x, y in _batches(world):
            lo, hi = rank * MICRO, (rank + 1) * MICRO
            released.clear()
            saved.clear()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                pred = engine(x[lo:hi].to(rank_device()))
            loss = torch.nn.functional.mse_loss(pred, y[lo:hi].to(rank_device()))
            held = set(saved)
            alive_after_forward.append((sum(r in held for r in released), len(released)))
            engine.backward(loss)
            engine.step()
        with deepspeed_c.zero.GatheredParameters(list(engine.module.parameters())):
            weights = [p.detach().cpu().numpy().copy() for p in engine.module.parameters()]
        out[str(efficient)] = {"alive": alive_after_forward, "weights": weights}
        engine.destroy()
    ParamStore.release = original  # type: ignore[method-assign]
    return out


def _reference(world: int) -> list[np.ndarray]:
    model = _model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    for x, y in _batches(world):
        # each rank's mean loss over its micro-batch, averaged over ranks: the mean over the whole batch
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().numpy() for p in model.parameters()]


def test_linear_weights_released_between_forward_and_backward() -> None:
    world = 2
    results = run_distributed(body, world, timeout=240)
    ref = _reference(world)
    for res in results:
        efficient, plain = res["True"], res["False"]
        for alive, total in efficient["alive"]:
            assert total >= 3, "the forward released too few gathered units for the check to mean anything"
            assert alive == 0, f"{alive} of {total} released Linear buffers still alive before the backward"
        # torch's linear saves weight.t() wherever the layer's input needs a gradient (all but the first)
        assert all(alive >= 1 for alive, total in plain["alive"]), plain["alive"]
        for run in (efficient, plain):
            for mine, want in zip(run["weights"], ref):
                rel = np.linalg.norm(mine - want) / np.linalg.norm(want)
                assert rel < 1e-5, rel
