"""An AutoTP ZeRO-3 checkpoint (per tensor-parallel rank files, each rank's partitions of its shards) saved by 4
ranks at TP 2 x DP 2 and loaded by 2 ranks at TP 2 x DP 1: the partitions are re-cut for the new data-parallel
size. Reference: the saving run continued without a break; the loaded run's next 3 losses (the same global
batches) must equal it within fp32 rounding (the data-parallel mean is taken over another number of ranks).
Also: AutoTP at ZeRO-3 on a model built under zero.Init."""
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


def _zero_init_losses(rank: int, world: int, tp: int) -> list[float]:
    """A model built under zero.Init (its parameters ZeRO-3 partitions from the start, as transformers'
    from_pretrained gives them under HfDeepSpeedConfig) trained 3 steps on one batch (every rank the same)."""
    import deepspeed_c

    cfg = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "optimizer": {"type": "Adam", "params": {"lr": LR}}, "zero_optimization": {"stage": 3}}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
        cfg["train_batch_size"] = ROWS * world  # DeepSpeed's arithmetic under AutoTP counts every rank
    with deepspeed_c.zero.Init(config_dict_or_path=cfg):
        model = tp_models.make_model("llama", seed=0, kv_heads=4)
    engine = deepspeed_c.initialize(model=model, config=cfg)[0]
    batch = tp_models.batches(1, ROWS, seed=3)[0]
    out = []
    for _ in range(3):
        loss = tp_models.loss_of(engine, batch)
        engine.backward(loss)
        engine.step()
        out.append(float(loss.detach()))
    return out


def test_autotp_shards_a_model_built_under_zero_init() -> None:
    """AutoTP at ZeRO-3 on a zero.Init model (it raised IndexError: the placeholders have no shape to split): the
    whole weights are gathered to be sharded; its losses equal the same zero.Init model's without AutoTP."""
    sharded = run_distributed(_zero_init_losses, 2, args=(2,), timeout=300)
    plain = run_distributed(_zero_init_losses, 2, args=(1,), timeout=300)
    for rank in range(2):
        assert np.allclose(sharded[rank], plain[rank], rtol=1e-5, atol=0), (rank, sharded[rank], plain[rank])
        assert plain[rank][0] != plain[rank][-1]  # it trained
