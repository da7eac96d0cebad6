"""An AutoTP ZeRO-3 checkpoint (per tensor-parallel rank files, each rank's partitions of its shards) saved by 4
ranks at TP 2 x DP 2 and loaded by 2 ranks at TP 2 x DP 1: the partitions are re-cut for the new data-parallel
size. Reference: the saving run continued without a break; the loaded run's next 3 losses (the same global
batches) must equal it within fp32 rounding (the data-parallel mean is taken over another number of ranks)."""
from __future__ import annotations

import numpy as np

from tests.distributed import tp_models
from tests.distributed.test_tp_checkpoint_tp4 import ROWS, _run as run_steps
from tests.harness import run_distributed

LR = 1e-2


def _engine(seed: int, world: int):
    import deepspeed_c

    cfg = {"train_micro_batch_size_per_gpu": ROWS * 2 // world, "gradient_accumulation_steps": 1,
           "gradient_clipping": 0.0, "optimizer": {"type": "Adam", "params": {"lr": LR}},
           "zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2}}
    return deepspeed_c.initialize(model=tp_models.make_model("llama", seed=seed, kv_heads=4), config=cfg)[0]


def _save(rank: int, world: int, path: str) -> list[float]:
    data = tp_models.batches(6, ROWS, seed=3)
    engine = _engine(0, world)
    run_steps(engine, data, range(3))
    engine.save_checkpoint(path, tag="t")
    return run_steps(engine, data, range(3, 6))


def _load(rank: int, world: int, path: str) -> list[float]:
    engine = _engine(1, world)  # other initial weights: everything must come from the checkpoint
    engine.load_checkpoint(path, tag="t")
    return run_steps(engine, tp_models.batches(6, ROWS, seed=3), range(3, 6))


def test_autotp_zero3_checkpoint_loads_at_another_data_parallel_size(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(_save, 4, args=(path,), timeout=300)[0]
    for rank, resumed in enumerate(run_distributed(_load, 2, args=(path,), timeout=300)):
        assert np.allclose(resumed, uninterrupted, rtol=1e-6, atol=0), (rank, resumed, uninterrupted)
