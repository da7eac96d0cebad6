"""AutoTP (autotp_size 2 on 2 gloo ranks) in the training forms users combine it with: Hugging Face activation
checkpointing (the row-parallel all-reduces run again in the recomputation), gradient accumulation (2
micro-batches a step) and a frozen token embedding, with a client SGD built before initialize (the Hugging Face
Trainer's order), at ZeRO 0 and 1.

Reference: the same tiny LLaMA in one process, the same embedding frozen, each step the mean loss of the step's
micro-batches back-propagated once, torch.optim.SGD (plain SGD: a gradient off by any factor shows in the
weights). Checked: every micro-batch's loss and every weight after the steps (the shards gathered into the whole
model), fp32, norm-wise relative; the frozen embedding unchanged."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tests.distributed import tp_models
from tests.harness import run_distributed

STEPS, GAS, MICRO, LR, TOL = 3, 2, 2, 0.5, 1e-5
FROZEN = "model.embed_tokens.weight"


def _model() -> torch.nn.Module:
    model = tp_models.make_model("llama", kv_heads=4)
    model.get_parameter(FROZEN).requires_grad_(False)
    model.gradient_checkpointing_enable()
    model.train()
    return model


def _data() -> list[torch.Tensor]:
    return tp_models.batches(STEPS * GAS, MICRO, seed=5)


def reference() -> dict[str, Any]:
    model = _model()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    data, losses = _data(), []
    for s in range(STEPS):
        opt.zero_grad()
        per = [tp_models.loss_of(model, b) for b in data[s * GAS:(s + 1) * GAS]]
        sum(per).div(GAS).backward()
        opt.step()
        losses += [float(x.detach()) for x in per]
    return {"losses": losses, "state": tp_models.full_state(model)}


def _body(rank: int, world: int) -> dict[str, Any]:
    import deepspeed_c
    from deepspeed_c.utils import groups

    out = {}
    for stage in (0, 1):
        model = _model()
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0,
               "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage},
               "tensor_parallel": {"autotp_size": 2}}
        model = deepspeed_c.tp_model_init(model=model, tp_size=2, dtype=torch.float32, config=cfg)
        params = [p for p in model.parameters() if p.requires_grad]
        engine = deepspeed_c.initialize(model=model, optimizer=torch.optim.SGD(params, lr=LR),
                                        model_parameters=params, config=cfg)[0]
        losses = []
        for b in _data():
            loss = tp_models.loss_of(engine, b)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        out[stage] = {"losses": losses, "state": tp_models.full_state(engine.module), "steps": engine.global_steps}
        groups._reset_tp_groups()
    return out


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b.astype(np.float64)), 1e-30))


def test_autotp_checkpointing_accumulation_frozen_embedding() -> None:
    results = run_distributed(_body, 2, timeout=300)
    ref = reference()
    init = tp_models.full_state(_model())
    for rank, res in enumerate(results):
        for stage, r in res.items():
            what = f"ZeRO {stage} rank {rank}"
            assert r["steps"] == STEPS, (what, r["steps"])
            assert np.allclose(r["losses"], ref["losses"], rtol=TOL, atol=0), (what, r["losses"], ref["losses"])
            assert set(r["state"]) == set(ref["state"]), what
            for k, w in ref["state"].items():
                if k == FROZEN:
                    assert np.array_equal(r["state"][k], init[k]), f"{what}: the frozen embedding changed"
                    continue
                assert _rel(init[k], w) > 1e-4, f"{k}: the reference barely moved it"  # norms move least: 3.5e-4
                assert _rel(r["state"][k], w) < TOL, f"{what} {k}: relative difference {_rel(r['state'][k], w):.3g}"
