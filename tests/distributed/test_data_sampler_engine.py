"""The data-efficiency curriculum sampler through initialize (data_efficiency.data_sampling.curriculum_learning):
the engine's training loader hands each of 2 gloo ranks its slice of DeepSpeed 0.19.8's global order (pinned
in tests/fixtures/data_efficiency/sampler_orders.npz); the sampler's state goes into the checkpoint's
`data_sampler` (DeepSpeed's key) and a fresh engine loading it continues with the identical order. Bad metric
keys and missing index files fail at initialize naming the key."""
from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

from tests.fixtures.data_efficiency import sampler_cases as C
from tests.harness import run_distributed

CASE, WORLD, GAS, SAVE_AT = "value_linear", 2, 2, 23  # micro-steps before the checkpoint (mid global batch)


def _config(clusters: str) -> dict:
    return {"train_micro_batch_size_per_gpu": C.GLOBAL_BATCH // WORLD // GAS, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
            "data_efficiency": C.data_efficiency_config(CASE, clusters)}


def _engine(clusters: str):
    import deepspeed_c

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.arange(C.SAMPLES, dtype=torch.float32)[:, None])
    engine, _, loader, _ = deepspeed_c.initialize(model=torch.nn.Linear(1, 1), config=_config(clusters),
                                                  training_data=data)
    return engine, loader


def _run(engine, it, steps: int) -> list:
    seen = []
    for _ in range(steps):
        (x, ) = next(it)
        seen.append([int(v) for v in x[:, 0].tolist()])
        loss = engine(x / C.SAMPLES).pow(2).mean()
        engine.backward(loss)
        engine.step()
    return seen


def body(rank: int, world: int, root: str) -> dict:
    engine, loader = _engine(os.path.join(root, "clusters"))
    assert engine.curriculum_learning_enabled() and engine.data_efficiency_enabled()
    total = C.GLOBAL_BATCH * C.GLOBAL_BATCHES // (C.GLOBAL_BATCH // GAS)
    it = iter(loader)
    head = _run(engine, it, SAVE_AT)
    engine.save_checkpoint(os.path.join(root, "ckpt"), tag="mid")
    saved = torch.load(os.path.join(root, "ckpt", "mid", "mp_rank_00_model_states.pt"), weights_only=False)
    engine.destroy()
    engine2, loader2 = _engine(os.path.join(root, "clusters"))
    engine2.load_checkpoint(os.path.join(root, "ckpt"), tag="mid")
    tail = _run(engine2, iter(loader2), total - SAVE_AT)
    engine2.destroy()
    return {"seen": head + tail, "saved_step": saved["data_sampler"]["curriculum_step"]}


def test_engine_loader_yields_deepspeed_order_and_resumes(tmp_path):
    with np.load(os.path.join(C.HERE, "sampler_orders.npz")) as data:
        pinned = data[CASE].tolist()
    results = run_distributed(body, world_size=WORLD, args=(str(tmp_path), ), timeout=300)
    order = []
    for step in range(len(results[0]["seen"])):
        for res in results:
            order.extend(res["seen"][step])
    assert order == pinned
    assert results[0]["saved_step"] == (SAVE_AT + GAS - 1) // GAS  # a global batch is one curriculum step


@pytest.mark.parametrize("over, err, key", [
    ({"difficulty_type": "ratio"}, ValueError, "curriculum_metrics.seqlen.difficulty_type"),
    ({"index_to_sample_path": "/nonexistent/x"}, ValueError, "curriculum_metrics.seqlen.index_to_sample_path"),
    ({"schedule_type": "fixed_cubic"}, ValueError, "curriculum_metrics.seqlen.schedule_type"),
])
def test_bad_metric_fails_at_initialize(tmp_path, over, err, key):
    import deepspeed_c

    cfg = _config(str(tmp_path))
    cfg["data_efficiency"]["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["seqlen"].update(over)
    with pytest.raises(err, match=key.replace(".", r"\.")):
        deepspeed_c.initialize(model=torch.nn.Linear(1, 1), config=copy.deepcopy(cfg))
