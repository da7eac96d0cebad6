"""The background writer's staging pool: buffers reused from save to save, never while a write reads them,
and every staged copy equal to the tensor at staging time (independent of later changes)."""
from collections import OrderedDict

import torch

from deepspeed_c.runtime.checkpointing.staging_pool import StagingPool


def _state(scale: float) -> dict:
    return {"module": OrderedDict(w=torch.full((4, 3), scale), b=torch.arange(5.0) * scale),
            "opt": [torch.ones(7, dtype=torch.float64) * scale, (torch.tensor([1, 2]) * int(scale),)], "step": 3}


def test_copies_are_independent_and_equal():
    pool, live = StagingPool(), _state(2.0)
    staged = pool.snapshot(live, pin=False)
    expect = _state(2.0)
    live["module"]["w"].add_(100.0)
    live["opt"][0].mul_(-1)
    assert isinstance(staged["module"], OrderedDict) and staged["step"] == 3
    torch.testing.assert_close(staged["module"]["w"], expect["module"]["w"], rtol=0, atol=0)
    torch.testing.assert_close(staged["opt"][0], expect["opt"][0], rtol=0, atol=0)
    torch.testing.assert_close(staged["opt"][1][0], expect["opt"][1][0], rtol=0, atol=0)


def test_buffers_reused_only_after_recycle():
    pool = StagingPool()
    first = pool.snapshot(_state(1.0), pin=False)
    ptr = first["module"]["w"].data_ptr()
    second = pool.snapshot(_state(2.0), pin=False)  # the first save's write has not finished: new buffers
    assert second["module"]["w"].data_ptr() != ptr
    torch.testing.assert_close(first["module"]["w"], torch.full((4, 3), 1.0), rtol=0, atol=0)
    pool.recycle()
    third = pool.snapshot(_state(3.0), pin=False)
    assert third["module"]["w"].data_ptr() in (ptr, second["module"]["w"].data_ptr())
    torch.testing.assert_close(third["module"]["b"], torch.arange(5.0) * 3, rtol=0, atol=0)


def test_changed_layout_gets_fresh_buffers():
    pool = StagingPool()
    pool.snapshot({"a": torch.zeros(3), "b": torch.zeros(2)}, pin=False)
    pool.recycle()
    out = pool.snapshot({"a": torch.ones(4), "b": torch.ones(2) * 5}, pin=False)  # "a" grew
    torch.testing.assert_close(out["a"], torch.ones(4), rtol=0, atol=0)
    torch.testing.assert_close(out["b"], torch.ones(2) * 5, rtol=0, atol=0)
