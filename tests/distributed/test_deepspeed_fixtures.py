"""Checkpoints written by the real DeepSpeed 0.19.8 (tests/fixtures/deepspeed_written, made by its
make_fixtures.py) load into deepspeed_c's engine with the same config and continue training.

DeepSpeed's behaviour checked: its `load_checkpoint` on these files restores the model, the ZeRO-1/2
fp32 partitions (`bf16_zero_pp_rank_*` / `zero_pp_rank_*` files, unpadded last partition, loss scaler
pickled as an object) or the ZeRO-0 optimizer state, after which its next losses are the recorded
`next_losses`; its `zero_to_fp32` consolidates the same files into `consolidated_fp32`.
Tolerances: losses relative 1e-5 (fp32) / 2e-2 (bf16: forward in bf16); weights norm-wise relative
1e-6 per tensor against DeepSpeed's consolidated fp32 (masters are fp32 on both sides)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.harness import run_distributed

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "deepspeed_written")
sys.path.insert(0, HERE)
import common  # noqa: E402


def _resume(rank: int, world: int, case: tuple) -> dict:
    import deepspeed_c
    from deepspeed_c.utils.tensor_fragment import safe_get_full_fp32_param

    stage, bf16, frozen, _ = case
    model = common.build_model(frozen)
    engine, *_ = deepspeed_c.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                        config=common.config(stage, bf16, world))
    ckpt = os.path.join(HERE, common.case_name(*case))
    path, _ = engine.load_checkpoint(ckpt, tag=common.TAG)
    assert path is not None
    weights = {}
    for name, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p) if stage > 0 and p.requires_grad else None
        # plain lists: tensors would travel between processes as shared-memory handles
        weights[name] = (full if full is not None else p.detach()).double().tolist()
    losses = []
    for i in range(common.STEPS_AFTER_RESUME):
        x, y = common.batch(common.STEPS_BEFORE_SAVE + i, rank, world)
        loss = engine(x.to(torch.bfloat16 if bf16 else torch.float32), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        if world > 1:
            torch.distributed.all_reduce(mean)
        losses.append(float(mean) / world)
    return {"losses": losses, "weights": weights}


def _check(case: tuple, got: dict) -> None:
    expected = torch.load(os.path.join(HERE, common.case_name(*case), "expected.pt"), weights_only=True)
    rtol = 2e-2 if case[1] else 1e-5
    for ours, theirs in zip(got["losses"], expected["next_losses"]):
        assert abs(ours - theirs) <= rtol * abs(theirs), (got["losses"], expected["next_losses"])
    for name, ref in expected.get("consolidated_fp32", {}).items():
        mine = torch.tensor(got["weights"][name], dtype=torch.float64)
        assert mine.shape == ref.shape, name
        err = (mine.double() - ref.double()).norm() / ref.double().norm()
        assert err <= 1e-6, (name, float(err))


SINGLE = [c for c in common.cases() if c[3] == 1]
DOUBLE = [c for c in common.cases() if c[3] == 2]


@pytest.mark.parametrize("case", SINGLE, ids=[common.case_name(*c) for c in SINGLE])
def test_deepspeed_checkpoint_resumes_single_rank(case: tuple) -> None:
    _check(case, run_distributed(_resume, 1, args=(case,))[0])


def _all_double(rank: int, world: int) -> list:
    return [_resume(rank, world, case) for case in DOUBLE]


def test_deepspeed_checkpoints_resume_two_ranks() -> None:
    """All 2-rank fixtures (stages 1 and 2, fp32/bf16, frozen or not) in one 2-process run."""
    results = run_distributed(_all_double, 2)
    for i, case in enumerate(DOUBLE):
        _check(case, results[0][i])
