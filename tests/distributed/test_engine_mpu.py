"""An `mpu` whose model-parallel world size is above 1 is read through DeepSpeed's mpu protocol (issue 54):
one that lacks a method the protocol needs is refused at initialize, naming it (before issue 54 any such
mpu was refused). An mpu of model-parallel size 1 (Megatron's data-parallel-only mpu) trains. 2 gloo ranks."""
from __future__ import annotations

import torch

from tests.distributed.engine_models import loss_fn, make_batches, make_model
from tests.harness import run_distributed


class _MPU:
    def __init__(self, mp: int) -> None:
        import torch.distributed as dist

        self.mp = mp
        self.group = dist.new_group(list(range(dist.get_world_size())))

    def get_model_parallel_world_size(self) -> int:
        return self.mp

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_group(self):
        return self.group

    def get_data_parallel_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size() // self.mp

    def get_data_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() // self.mp


def body(rank: int, world: int) -> dict:
    import deepspeed_c

    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 0.0,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    out = {}
    try:
        deepspeed_c.initialize(model=make_model("mlp", seed=0), config=dict(cfg, train_batch_size=2), mpu=_MPU(2))
        out["mp2"] = "accepted"
    except TypeError as e:
        out["mp2"] = str(e)
    engine, *_ = deepspeed_c.initialize(model=make_model("mlp", seed=0), config=cfg, mpu=_MPU(1))
    (x, y), = make_batches("mlp", 1, 2 * world, seed=1)
    dev = engine.device
    engine.backward(loss_fn(engine(x[2 * rank:2 * rank + 2].to(dev)), y[2 * rank:2 * rank + 2].to(dev)))
    engine.step()
    out["mp1_steps"] = engine.global_steps
    return out


def test_model_parallel_mpu_missing_a_method_refused():
    for r in run_distributed(body, 2, timeout=120):
        assert "get_model_parallel_group" in r["mp2"] and "mpu" in r["mp2"], r["mp2"]
        assert r["mp1_steps"] == 1
