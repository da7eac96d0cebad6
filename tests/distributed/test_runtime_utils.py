"""deepspeed_c.runtime.utils (DeepSpeed's deepspeed.runtime.utils helpers): clip_grad_norm_ against
torch.nn.utils.clip_grad_norm_ (and, with a model-parallel mpu over 2 gloo ranks each holding half
of the gradients, against the norm of the whole), move_to_device, get_global_norm, and
see_memory_usage logging only when forced."""
from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from deepspeed_c.runtime import utils as ds_utils
from tests.harness import run_distributed


def _params(seed: int, scale: float = 1.0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (7, 33, 128)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return ps


@pytest.mark.parametrize("norm_type", [2, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 1e4])
def test_clip_grad_norm_matches_torch(norm_type, max_norm):
    ours, ref = _params(1), _params(1)
    got = ds_utils.clip_grad_norm_(ours, max_norm, norm_type=norm_type)
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type)
    assert abs(got - float(want)) <= 1e-6 * float(want)
    for a, b in zip(ours, ref):
        assert torch.linalg.vector_norm(a.grad - b.grad) <= 1e-6 * torch.linalg.vector_norm(b.grad)


def test_clip_grad_norm_rejects_other_norms():
    with pytest.raises(ValueError, match="norm_type"):
        ds_utils.clip_grad_norm_(_params(1), 1.0, norm_type=1)


class _MPU:
    def get_model_parallel_group(self):
        import torch.distributed as dist

        return dist.group.WORLD

    def get_model_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()


def mpu_body(rank: int, world: int) -> dict:
    full = _params(3)
    # each rank holds a shard (DeepSpeed's tensor_model_parallel attribute) and the replicated last one
    mine = [full[i] for i in range(len(full) - 1) if i % world == rank] + [full[-1]]
    for p in mine[:-1]:
        p.tensor_model_parallel = True
    norm = ds_utils.clip_grad_norm_(mine, 0.5, mpu=_MPU())
    idx = [i for i in range(len(full) - 1) if i % world == rank] + [len(full) - 1]
    # no mpu, each rank its own gradients (MoE experts): as DeepSpeed, the norm is the ranks' mean, one coefficient
    own = _params(10 + rank)
    dp_norm = ds_utils.clip_grad_norm_(own, 0.5)
    return {"norm": float(norm), "grads": [p.grad.numpy().copy() for p in mine], "idx": idx,
            "dp_norm": float(dp_norm), "dp_grads": [p.grad.numpy().copy() for p in own]}


def test_clip_grad_norm_with_mpu_covers_every_shard():
    """DeepSpeed's rule: split parameters count on every model-parallel rank, replicated ones once."""
    res = run_distributed(mpu_body, 2, timeout=120)
    ref = _params(3)
    want = float(torch.nn.utils.clip_grad_norm_(ref, 0.5))
    for r in res:
        assert abs(r["norm"] - want) <= 1e-6 * want
        for i, g in zip(r["idx"], r["grads"]):
            np.testing.assert_allclose(g, ref[i].grad.numpy(), rtol=1e-6, atol=1e-7)
    norms = [float(torch.linalg.vector_norm(torch.cat([p.grad for p in _params(10 + r)]))) for r in range(2)]
    mean = sum(norms) / 2
    for r, res_r in enumerate(res):
        assert abs(res_r["dp_norm"] - mean) <= 1e-6 * mean
        for g, p in zip(res_r["dp_grads"], _params(10 + r)):
            np.testing.assert_allclose(g, p.grad.numpy() * 0.5 / (mean + 1e-6), rtol=1e-5)


def test_move_to_device_nested():
    item = {"a": [torch.ones(2), (torch.zeros(1), 3)], "b": "text"}
    out = ds_utils.move_to_device(item, "cpu")
    assert isinstance(out["a"], list) and isinstance(out["a"][1], tuple) and out["a"][1][1] == 3 and out["b"] == "text"
    assert torch.equal(out["a"][0], torch.ones(2))


def test_get_global_norm():
    assert ds_utils.get_global_norm([3.0, 4.0]) == pytest.approx(5.0)


def test_see_memory_usage_logs_only_when_forced(caplog):
    from deepspeed_c.utils.logging import logger

    logger.propagate, old = True, logger.propagate
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            ds_utils.see_memory_usage("quiet")
            assert "quiet" not in caplog.text
            ds_utils.see_memory_usage("after init", force=True)
        assert "after init" in caplog.text and "MA " in caplog.text and "CPU Virtual Memory" in caplog.text
    finally:
        logger.propagate = old


def test_deepspeed_import_path():
    import deepspeed_c

    assert deepspeed_c.runtime.utils.see_memory_usage is ds_utils.see_memory_usage
