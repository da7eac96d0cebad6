"""How the engine scales and reduces gradients, with the models users train.

- `engine.backward(loss)` divides exactly the loss it is given by gradient_accumulation_steps,
  whatever else the model returned (DeepSpeed: `loss = loss / self.gradient_accumulation_steps()`
  in engine.backward). Models: (logits, aux_loss) trained on mse + aux; a dict output; a Hugging
  Face causal LM whose loss the user computes from the logits while the model also returns its own.
  Before the fix the scaling rode on hooks on the scalar outputs only, so these got gradients GAS
  times too large.
- A direct `loss.backward()` (DeepSpeed >= 0.18.3 accepts it) gives the same gradients.
- LoRA-style frozen parameters with activation checkpointing, reentrant and non-reentrant, whose
  first gradient arrives inside a checkpoint: exactly one reduction round per backward (before the
  fix a reentrant checkpoint's nested graph task closed the round early: stage 1 added gradients
  twice, stages 0 and 2 reduced once per segment).
Reference: single-process PyTorch on the global batch (each micro-batch's user loss / GAS, summed
into .grad; SGD), float64. Tolerance: weights after 3 steps within 1e-5 norm-wise relative per
tensor (fp32); a 2x gradient error shows as >= 1e-2 here. Stages 0, 1 and 2 on 2 gloo ranks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.distributed import backward_models as bm
from tests.harness import run_distributed

STEPS, MICRO, LR = 3, 2, 0.1
CASES = [("aux", 2, "engine"), ("dict", 4, "engine"), ("hf", 2, "engine"), ("aux", 4, "direct"),
         ("hf", 4, "direct"), ("lora-reentrant", 2, "engine"), ("lora-reentrant", 1, "engine"),
         ("lora-nonreentrant", 4, "engine"), ("lora-reentrant", 2, "direct")]


def body(rank: int, world: int) -> dict:
    import deepspeed_c

    out = {}
    for kind, gas, route in CASES:
        for stage in (0, 1, 2):
            model = bm.make(kind, seed=11)
            cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
                   "steps_per_print": 10**9, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
                   "optimizer": {"type": "SGD", "params": {"lr": LR}},
                   "zero_optimization": {"stage": stage, "reduce_bucket_size": 64}}
            engine, *_ = deepspeed_c.initialize(model=model, config=cfg,
                                                model_parameters=[p for p in model.parameters() if p.requires_grad])
            rounds = []
            for batch in bm.batches(kind, STEPS * gas, MICRO * world, seed=5):
                before = engine.reducer.rounds
                local = bm.shard(kind, batch, rank, MICRO, engine.device)
                loss = bm.user_loss(kind, bm.run_model(kind, engine, local), local)
                if route == "engine":
                    engine.backward(loss)
                else:
                    loss.backward()
                rounds.append(engine.reducer.rounds - before)
                engine.step()
            out[(kind, gas, route, stage)] = {
                "rounds": rounds,
                "weights": {n: p.detach().double().cpu().numpy().copy() for n, p in engine.module.named_parameters()}}
            engine.destroy()
    return out


def reference(kind: str, gas: int, world: int) -> dict:
    model = bm.make(kind, seed=11).double()
    params = [p for p in model.parameters() if p.requires_grad]
    data = bm.batches(kind, STEPS * gas, MICRO * world, seed=5)
    for s in range(STEPS):
        for p in params:
            p.grad = None
        for batch in data[s * gas:(s + 1) * gas]:
            if kind != "hf":
                batch = (batch[0].double(), batch[1].double())
            loss = bm.user_loss(kind, bm.run_model(kind, model, batch), batch)
            (loss / gas).backward()
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
    return {n: p.detach().numpy() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(body, 2, timeout=600)


@pytest.mark.parametrize("kind,gas,route", CASES)
def test_gradients_and_rounds(runs, kind, gas, route):
    ref = reference(kind, gas, 2)
    for stage in (0, 1, 2):
        got = runs[0][(kind, gas, route, stage)]
        for name, want in ref.items():
            err = np.linalg.norm(got["weights"][name] - want) / max(np.linalg.norm(want), 1e-30)
            assert err < 1e-5, f"stage {stage} {kind} gas {gas} {route}: {name} rel err {err:.2e}"
            assert np.array_equal(got["weights"][name], runs[1][(kind, gas, route, stage)]["weights"][name])
        # one reduction round per reducing backward: stage 2 every micro-step, else on the boundary
        expect = [1] * (STEPS * gas) if stage == 2 else [1 if (i + 1) % gas == 0 else 0 for i in range(STEPS * gas)]
        assert got["rounds"] == expect, f"stage {stage} {kind} {route}: rounds per backward {got['rounds']}"
