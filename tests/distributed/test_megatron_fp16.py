"""fp16 loss scaling under a client's tensor parallelism (issue 54), 4 gloo ranks, TP 2 x DP 2: overflow is
decided for the whole model. Rank 1 alone multiplies its loss by inf at step 3: every rank must skip that
one step (ZeRO 0 and 2), the parameters replicated over the tensor pair must stay equal on every rank, and
the losses before the overflow must follow the fp32 one-process run of the unsplit model (fp16 tolerance)."""
from __future__ import annotations

import numpy as np
import torch

from tests.distributed import megatron_models as mm
from tests.distributed.test_megatron_mpu import CLIP, EPS, LR, MICRO, config
from tests.harness import run_distributed

BAD, STEPS = 3, 5


def _run(stage: int, rank: int, mpu: mm.MegatronMPU, data: list) -> dict:
    import deepspeed_c

    cfg = dict(config(stage), fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000})
    engine, *_ = deepspeed_c.initialize(model=mm.sharded_model(mpu), config=cfg, mpu=mpu)
    d, losses = mpu.get_data_parallel_rank(), []
    for i, tokens in enumerate(data):
        loss = engine(tokens[d * MICRO:(d + 1) * MICRO])
        engine.backward(loss * float("inf") if (i == BAD and rank == 1) else loss)
        engine.step()
        t = loss.detach().float().clone()
        torch.distributed.all_reduce(t, group=mpu.get_data_parallel_group())
        losses.append(t.item() / mpu.dp)
    spread = 0.0
    for p in engine.module.parameters():
        if not getattr(p, "tensor_model_parallel", False):
            lo, hi = p.detach().float().clone(), p.detach().float().clone()
            torch.distributed.all_reduce(lo, op=torch.distributed.ReduceOp.MIN)
            torch.distributed.all_reduce(hi, op=torch.distributed.ReduceOp.MAX)
            spread = max(spread, (hi - lo).abs().max().item())
    return {"skipped": engine.skipped_steps, "spread": spread, "losses": losses}


def body(rank: int, world: int) -> dict:
    mpu = mm.MegatronMPU(tp=2)
    data = mm.batches(STEPS, MICRO * mpu.dp, seed=4)
    ref_losses, _, _ = mm.reference_training(data[:BAD], LR, EPS, CLIP)
    out = {}
    for stage in (0, 2):
        got = _run(stage, rank, mpu, data)
        got["loss_err"] = float(np.max(np.abs(np.array(got["losses"][:BAD]) - ref_losses)))
        out[stage] = got
    return out


def test_fp16_overflow_on_one_rank_skips_everywhere():
    for r in run_distributed(body, 4, timeout=400):
        for stage in (0, 2):
            got = r[stage]
            assert got["skipped"] == 1, (stage, got)
            assert got["spread"] == 0.0, (stage, got)
            assert got["loss_err"] < 2e-2, (stage, got)
