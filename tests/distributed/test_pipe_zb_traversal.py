"""ZB-H1 runs one backward traversal per micro-batch (runtime/pipe/deferred_wgrad.py): on 2 gloo ranks (2
stages, the tied model of pipe_models, clipping, 4 micro-batches) every Linear's backward runs once per
forward call, where the former two-traversal split (B for the input gradients, W again from the outputs
for the parameters) ran it twice; the weights after 3 steps equal the 1F1B run's and single-process
PyTorch's. A stage with a tensor hook on a parameter takes the two-traversal path (twice per forward call
on the stage that sends input gradients upstream) and still trains the same; so does ZB-H1 over a ZeRO-1
optimizer."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tests.distributed import pipe_models as pm
from tests.distributed.test_pipe_parity import LR, _engine, _layer_weights
from tests.harness import run_distributed

STEPS, CLIP = 3, 0.05


def body(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, schedule, hook, zero in (("1f1b", "1f1b", False, 0), ("zb", "zb_h1", False, 0),
                                       ("zb-hook", "zb_h1", True, 0), ("zb-zero1", "zb_h1", False, 1)):
        model, engine = _engine(world, 2, clip=CLIP, schedule=schedule, zero=zero)
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        forwards = [0]
        handles = [m.register_forward_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1)) for m in linears]
        if hook:  # an identity hook: same gradients, but it must see them
            next(p for p in model.parameters() if p.requires_grad).register_hook(lambda g: g)
        for step in pm.batches(STEPS, 1):
            engine.train_batch(iter(step))
        store = engine.deferred_wgrad
        out[name] = {"weights": _layer_weights(model), "forwards": forwards[0], "stage": engine.stage_id,
                     "backwards": store.linear_backwards if store is not None else None}
        for h in handles:
            h.remove()
        engine.destroy()
        out[name]["restored"] = all("forward" not in m.__dict__ for m in linears)
    return out


def test_zb_h1_runs_each_linear_backward_once_and_trains_like_1f1b() -> None:
    _, want = pm.reference(STEPS, 1, LR, CLIP)
    for res in run_distributed(body, 2, timeout=240):
        assert res["1f1b"]["backwards"] is None
        for name in ("zb", "zb-zero1"):  # ZeRO-1's in-place bucket writes give way to the deferral
            assert res[name]["forwards"] > 0 and res[name]["backwards"] == res[name]["forwards"], res[name]
        # the first stage has no input gradients to send: its B pass does not traverse, W does once
        twice = 1 if res["zb-hook"]["stage"] == 0 else 2
        assert res["zb-hook"]["backwards"] == twice * res["zb-hook"]["forwards"], res["zb-hook"]
        for name in ("1f1b", "zb", "zb-hook", "zb-zero1"):
            assert res[name]["restored"], name
            for key, w in res[name]["weights"].items():
                for other in (res["1f1b"]["weights"][key], want[key]):
                    rel = np.linalg.norm(w - other) / np.linalg.norm(other)
                    assert rel < 1e-5, f"{name} {key}: {rel:.3g}"
