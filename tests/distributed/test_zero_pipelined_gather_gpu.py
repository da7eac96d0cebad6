"""ZeRO-1/2 on 2 GPUs (NCCL, bf16, AdamW, clipping): the optimizer epilogue launched bucket by bucket
with each bucket's all-gather started as soon as its range is stepped (the default) must give the
same masters, moments and bf16 weights, bit for bit, as the epilogue over the whole partition
followed by the all-gathers (DSC_ZERO_PIPELINED_GATHER=0). The kernel is elementwise, so any
difference means a range was stepped twice, skipped, or stepped at another step count (bias
correction). Small buckets make several ranges per group; two param groups (no decay for biases).
The whole-partition path itself is checked against single-GPU references in test_engine_parity_gpu."""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from tests.distributed.engine_models import loss_fn, make_batches, make_model
from tests.harness import run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA GPUs (NCCL)")

STEPS, MICRO, WORLD = 6, 4, 2


def body(rank: int, world: int, stage: int) -> dict[str, Any]:
    import deepspeed_c

    out: dict[str, Any] = {}
    for mode in ("1", "0"):
        os.environ["DSC_ZERO_PIPELINED_GATHER"] = mode
        model = make_model("transformer", seed=7)
        decay = [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith("bias")]
        no_decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("bias")]
        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.5, "bf16": {"enabled": True},
                  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 200}}
        engine, *_ = deepspeed_c.initialize(model=model, config=config,
                                            model_parameters=[{"params": decay},
                                                              {"params": no_decay, "weight_decay": 0.0}])
        batches = make_batches("transformer", STEPS, MICRO * world, seed=3)
        for x, y in batches:
            lo, hi = rank * MICRO, (rank + 1) * MICRO
            loss = loss_fn(engine(x[lo:hi].to(engine.device)).float(), y[lo:hi].to(engine.device))
            engine.backward(loss)
            engine.step()
        opt = engine.optimizer
        states = [opt.optimizer.state[m] for m in opt.fp32_partitions]
        out[mode] = {"masters": [m.detach().cpu().numpy() for m in opt.fp32_partitions],
                     "exp_avg": [s["exp_avg"].cpu().numpy() for s in states],
                     "exp_avg_sq": [s["exp_avg_sq"].cpu().numpy() for s in states],
                     "steps": [float(s["step"]) for s in states],
                     "weights": [p.detach().float().cpu().numpy() for p in engine.module.parameters()],
                     "buckets": [plan.num_buckets for plan in opt.partition_plans]}
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_pipelined_gather_equals_whole_step(stage: int) -> None:
    for res in run_distributed(body, WORLD, args=(stage,), timeout=300, backend="nccl"):
        piped, whole = res["1"], res["0"]
        assert max(piped["buckets"]) > 1, "the test needs several buckets per group"
        assert piped["steps"] == whole["steps"] == [float(STEPS)] * len(whole["steps"])
        for key in ("masters", "exp_avg", "exp_avg_sq", "weights"):
            for a, b in zip(piped[key], whole[key]):
                np.testing.assert_array_equal(a, b, err_msg=key)
