"""Which bucket-reduce strategy each configuration gets, and its pre/post factors
(deepspeed_c/runtime/reduce_strategy.py). The collectives are faked: these run in one process."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from deepspeed_c.runtime import reduce_strategy as rs


class _FakeComm:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def all_reduce(self, buf: torch.Tensor, group: Any = None, async_op: bool = False) -> None:
        self.calls.append(("all_reduce", group))

    def reduce_scatter_tensor(self, out: torch.Tensor, buf: torch.Tensor, op: Any = None, group: Any = None,
                              async_op: bool = False) -> None:
        self.calls.append(("reduce_scatter", op))
        out.copy_(buf[:out.numel()])


@pytest.fixture
def comm(monkeypatch: pytest.MonkeyPatch) -> _FakeComm:
    fake = _FakeComm()
    monkeypatch.setattr(rs, "_comm", lambda: fake)
    return fake


@pytest.mark.parametrize("kwargs, pre, post", [
    ({}, 1.0, 1 / 8),
    ({"gradient_predivide_factor": 2.0}, 0.5, 2 / 8),
    ({"prescale_gradients": True}, 1 / 8, 1.0),
    ({"gradient_average": False}, 1.0, 1.0),
    ({"gradient_average": False, "prescale_gradients": True}, 1.0, 1.0),
    ({"sequence_parallel_size": 2}, 1.0, 1 / 4),  # Ulysses: only the data-parallel replicas are averaged
])
def test_averaging_factors(kwargs: dict, pre: float, post: float) -> None:
    f = rs.averaging_factors(8, **kwargs)
    assert (f.pre, f.post) == pytest.approx((pre, post))


def test_partition_strategy_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = rs.averaging_factors(4)
    assert type(rs.partition_strategy(plain, rank=0, world_size=1, group=None)) is rs.LocalReduce
    s = rs.partition_strategy(plain, rank=2, world_size=4, group=None, reduce_scatter=False)
    assert type(s) is rs.AllReduce and s.keep_rank == 2 and not s.writes_out
    q = rs.partition_strategy(plain, rank=0, world_size=4, group=None, quantized_reduce=lambda b: b)
    assert type(q) is rs.QuantizedReduceScatter and q.writes_out
    # qgZ only replaces a reduce-scatter: reduce_scatter false keeps the all-reduce
    s = rs.partition_strategy(plain, rank=0, world_size=4, group=None, reduce_scatter=False,
                              quantized_reduce=lambda b: b)
    assert type(s) is rs.AllReduce
    for backend, average in (("gloo", False), ("nccl", True)):
        monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None, b=backend: b)
        s = rs.partition_strategy(plain, rank=0, world_size=4, group=None)
        assert type(s) is rs.ReduceScatter and s.average is average and s.writes_out
        # NCCL averages inside the collective: nothing left to scale after it
        assert (s.pre_factor, s.post_factor) == ((1.0, 1.0) if average else (1.0, 0.25))
    # NCCL, but not the plain average: a sum, scaled before and after
    s = rs.partition_strategy(rs.averaging_factors(4, gradient_predivide_factor=2.0), rank=0, world_size=4,
                              group=None)
    assert not s.average and (s.pre_factor, s.post_factor) == (0.5, 0.5)


def test_strategies_prescale_and_place_results(comm: _FakeComm) -> None:
    f = rs.ReduceFactors(0.5, 3.0)
    buf = torch.ones(8)
    work, out = rs.LocalReduce(f).reduce(buf)
    assert work is None and out is buf and torch.equal(buf, torch.full((8,), 0.5))
    ar = rs.AllReduce(f, "g", keep_rank=1, world_size=4)
    buf = torch.arange(8.0)
    _, out = ar.reduce(buf)
    assert torch.equal(out, torch.tensor([1.0, 1.5])) and out.data_ptr() == buf[2:].data_ptr()
    assert comm.calls == [("all_reduce", "g")] and ar.collectives == 1
    sc = rs.ReduceScatter(f, None, 4)
    dst = torch.empty(2)
    _, out = sc.reduce(torch.ones(8), dst)
    assert out is dst and torch.equal(dst, torch.full((2,), 0.5)) and sc.post_factor == 3.0
    q = rs.QuantizedReduceScatter(f, lambda b: b[:2] * 2, 4)
    _, out = q.reduce(torch.ones(8))
    assert torch.equal(out, torch.ones(2)) and q.collectives == 1


def test_stage0_reducer_takes_an_all_reduce() -> None:
    from deepspeed_c.runtime.reducer import GradientReducer

    p = torch.nn.Parameter(torch.zeros(4))
    r = GradientReducer([p], world_size=4, bucket_cap=16, should_reduce=lambda: False, gradient_predivide_factor=2.0)
    try:
        assert type(r.strategy) is rs.AllReduce and r.strategy.keep_rank is None
        assert (r.strategy.pre_factor, r.strategy.post_factor) == (0.5, 0.5) and r.collectives == 0
    finally:
        r.remove()
