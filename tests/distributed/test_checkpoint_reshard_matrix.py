"""Resharding on load across world sizes and ZeRO stages: a checkpoint saved with N ranks loads
into M ranks (and from stage 2 into stage 1) with identical consolidated fp32 weights and Adam
moments, no conversion step."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from tests.distributed.test_checkpoint_zero import MLP, consolidated_moments, loss_fn
from tests.harness import run_distributed


def body(rank: int, world: int, stage: int, src: str | None, dst: str) -> int:
    import deepspeed_c

    torch.manual_seed(2)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 100}}
    engine, *_ = deepspeed_c.initialize(model=MLP(), config=cfg)
    if src is None:
        g = torch.Generator().manual_seed(5)
        for _ in range(3):
            x, y = torch.randn(2 * world, 12, generator=g), torch.randn(2 * world, 3, generator=g)
            sl = slice(2 * rank, 2 * rank + 2)
            engine.backward(loss_fn(engine(x[sl].to(engine.device)), y[sl].to(engine.device)))
            engine.step()
    else:
        engine.load_checkpoint(src)
    engine.save_checkpoint(dst)
    return engine.global_steps


@pytest.mark.parametrize("n,m,src_stage,dst_stage", [(1, 2, 1, 1), (2, 4, 2, 2), (4, 2, 1, 1), (2, 1, 2, 2),
                                                     (2, 2, 2, 1)])
def test_reshard_matrix(tmp_path, n, m, src_stage, dst_stage):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert run_distributed(body, n, args=(src_stage, None, a), timeout=300) == [3] * n
    assert run_distributed(body, m, args=(dst_stage, a, b), timeout=300) == [3] * m  # counters restored
    ref, got = get_fp32_state_dict_from_zero_checkpoint(a), get_fp32_state_dict_from_zero_checkpoint(b)
    assert set(ref) == set(got) and all(torch.equal(ref[k], got[k]) for k in ref)
    ref_m, got_m = consolidated_moments(a), consolidated_moments(b)
    assert ref_m["exp_avg_sq"].abs().sum() > 0
    for key in ref_m:
        assert torch.equal(ref_m[key], got_m[key]), key
