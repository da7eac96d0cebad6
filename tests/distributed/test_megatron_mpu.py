"""initialize(mpu=...) with a client's Megatron-style tensor parallelism (issue 54), 4 gloo ranks.

TP 2 x DP 2 (tensor groups {0,1},{2,3}; data groups {0,2},{1,3}): the test's own column/row-parallel
GPT (tests/distributed/megatron_models.py) and mpu, fp32, gradient clipping that bites on every step.
Each rank also trains the unsplit model alone on the whole global batch (torch.optim.Adam and
torch.nn.utils.clip_grad_norm_): after 10 steps every gathered weight must equal it (norm-wise
relative error 1e-5 per tensor) at ZeRO stages 0, 1, 2 and 3, and the engine's global gradient norm
must be the unsplit model's at each step (replicated parameters counted once); also with 2 micro-batches
of gradient accumulation a step (ZeRO 0 and 2)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.distributed import megatron_models as mm
from tests.harness import run_distributed

STEPS, MICRO, LR, EPS, CLIP = 10, 2, 1e-2, 1e-4, 0.3


def config(stage: int, clip: float = CLIP, offload: bool = False) -> dict:
    zero: dict = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "gradient_clipping": clip, "zero_allow_untested_optimizer": True,
            "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "eps": EPS}},
            "zero_optimization": zero}


def train(engine: object, mpu: mm.MegatronMPU, data: list, steps: range) -> tuple[list[float], list[float]]:
    dp_rank, losses, norms = mpu.get_data_parallel_rank(), [], []
    for i in steps:
        loss = engine(data[i][dp_rank * MICRO:(dp_rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        norms.append(float(engine.get_global_grad_norm()))
        t = loss.detach().clone()
        torch.distributed.all_reduce(t, group=mpu.get_data_parallel_group())
        losses.append(t.item() / mpu.dp)
    return losses, norms


def _stage(stage: int, mpu: mm.MegatronMPU, data: list, ref: tuple, offload: bool = False) -> dict:
    import deepspeed_c

    ref_losses, ref_state, ref_norms = ref
    model = mm.sharded_model(mpu)
    engine, *_ = deepspeed_c.initialize(model=model, config=config(stage, offload=offload), mpu=mpu)
    from deepspeed_c.utils import groups  # DeepSpeed's groups.mpu: the queries answer from the client's mpu

    seen = (groups.get_data_parallel_world_size(), groups.get_data_parallel_rank(),
            groups.get_tensor_model_parallel_world_size(), groups.get_tensor_model_parallel_rank(),
            groups._get_data_parallel_group_ranks(), groups.get_tensor_model_parallel_src_rank())
    losses, norms = train(engine, mpu, data, range(STEPS))
    errs = mm.rel_errors(mm.full_state(engine.module, mpu.context()), ref_state)
    return {"weight_rel": max(errs.values()), "worst": max(errs, key=errs.get),
            "loss_err": float(np.max(np.abs(np.array(losses) - ref_losses))),
            "norm_rel": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
            "clipped": sum(n > CLIP for n in ref_norms), "dp": engine.dp_world_size, "groups": seen,
            "split": sum(bool(getattr(p, "ds_is_tensor_model_parallel", False)) for p in engine.module.parameters())}


def body(rank: int, world: int, stages: tuple) -> dict:
    mpu = mm.MegatronMPU(tp=2)
    data = mm.batches(STEPS, MICRO * mpu.dp)
    ref = mm.reference_training(data, LR, EPS, CLIP)
    out = {s: _stage(s, mpu, data, ref) for s in stages}
    if 2 in stages:
        out["offload"] = _stage(2, mpu, data, ref, offload=True)
    return out


def _check(results: list, keys: tuple) -> None:
    for rank, r in enumerate(results):
        for s in keys:
            got = r[s]
            assert got["groups"] == (2, rank // 2, 2, rank % 2, [rank % 2, rank % 2 + 2], rank - rank % 2), got["groups"]
            assert got["dp"] == 2 and got["split"] > 0, got
            assert got["clipped"] == STEPS, got  # the clip acted at every step: the norm decides the update
            assert got["norm_rel"] < 1e-5, (s, got)
            assert got["weight_rel"] < 1e-5, (s, got)
            assert got["loss_err"] < 1e-5, (s, got)


def _all_body(rank: int, world: int) -> dict:
    return {"stages": body(rank, world, (0, 1, 2, 3)), "gas": gas_body(rank, world, (0, 2))}


@pytest.fixture(scope="module")
def runs() -> list:
    """Every case of this module in one 4-rank launch (a 4-rank start on 2 cores costs more than a case):
    the same engines, steps and references as one launch per test."""
    return run_distributed(_all_body, 4, timeout=900)


def test_tp2_dp2_zero_0_1_equal_unsplit_training(runs):
    _check([r["stages"] for r in runs], (0, 1))


def test_tp2_dp2_zero_2_3_and_offload_equal_unsplit_training(runs):
    _check([r["stages"] for r in runs], (2, 3, "offload"))


def gas_body(rank: int, world: int, stages: tuple) -> dict:
    """Gradient accumulation: 2 micro-batches a step; the norm is taken (and clipped) at the boundary."""
    import deepspeed_c

    mpu, gas = mm.MegatronMPU(tp=2), 2
    data = mm.batches(STEPS, MICRO * mpu.dp * gas, seed=6)
    ref_losses, ref_state, ref_norms = mm.reference_training(data, LR, EPS, CLIP)
    out = {}
    for stage in stages:
        cfg = dict(config(stage), gradient_accumulation_steps=gas)
        engine, *_ = deepspeed_c.initialize(model=mm.sharded_model(mpu), config=cfg, mpu=mpu)
        d, norms = mpu.get_data_parallel_rank(), []
        for tokens in data:
            for m in range(gas):  # micro-batch m of this data-parallel rank: rows of the global batch
                rows = tokens[(m * mpu.dp + d) * MICRO:(m * mpu.dp + d + 1) * MICRO]
                engine.backward(engine(rows))
                engine.step()
            norms.append(float(engine.get_global_grad_norm()))
        errs = mm.rel_errors(mm.full_state(engine.module, mpu.context()), ref_state)
        out[stage] = {"weight_rel": max(errs.values()), "steps": engine.global_steps,
                      "norm_rel": max(abs(a - b) / b for a, b in zip(norms, ref_norms))}
    return out


def test_tp2_dp2_gradient_accumulation_equals_unsplit_training(runs):
    for r in (rank["gas"] for rank in runs):
        for stage in (0, 2):
            got = r[stage]
            assert got["steps"] == STEPS and got["norm_rel"] < 1e-5 and got["weight_rel"] < 1e-5, (stage, got)
