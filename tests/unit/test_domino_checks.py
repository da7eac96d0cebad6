"""Domino's single-process pieces: the handle table (every filed all-reduce waited once, by its half's
wait), the config checks and the micro-batch split (errors naming the argument), and the async linear's
backward against autograd's own linear at a tensor-parallel size of 1 (float64)."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.runtime.domino.config import DominoConfig, check_config, split_micro_batch, tp_group_of
from deepspeed_c.runtime.domino.handles import NoOper, file_handle, wait_handles


class _Work:
    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
        return True


def test_handles_filed_are_waited_once_by_their_half():
    table: dict = {"BATCH0": None, "BATCH1": None}
    a, b, c = _Work(), _Work(), _Work()
    file_handle(table, "BATCH0", a)
    file_handle(table, "BATCH0", b)
    file_handle(table, "BATCH1", c)
    file_handle(table, "BATCH1", None)  # a size-1 group files nothing
    wait_handles(table, "BATCH0")
    assert (a.waits, b.waits, c.waits) == (1, 1, 0) and table["BATCH0"] is None
    wait_handles(table, "BATCH0")  # nothing left: no second wait
    assert (a.waits, b.waits) == (1, 1)
    table["BATCH1"] = c  # a caller's table holding one bare handle, as DeepSpeed's does
    wait_handles(table, "BATCH1")
    assert c.waits == 1 and table["BATCH1"] is None


def test_wait_op_waits_in_backward_only():
    table: dict = {"BATCH0": None}
    work = _Work()
    x = torch.randn(3, requires_grad=True)
    y = NoOper.apply(x, table, "BATCH0")
    file_handle(table, "BATCH0", work)
    assert work.waits == 0
    (y * 2).sum().backward()
    assert work.waits == 1 and torch.equal(x.grad, torch.full((3,), 2.0))


def _cfg(**kw):
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4, perform_initialization=False)
    base.update(kw)
    return DominoConfig(**base)


def test_config_checks_name_the_attribute():
    with pytest.raises(ValueError, match=r"config.num_attention_heads \(6\) is not divisible .* \(4\)"):
        check_config(_cfg(num_attention_heads=6, hidden_size=24), 4, "DominoTransformer")
    with pytest.raises(ValueError, match=r"config.ffn_hidden_size \(30\)"):
        check_config(_cfg(ffn_hidden_size=30), 4, "DominoTransformer")
    with pytest.raises(ValueError, match=r"config.params_dtype"):
        check_config(_cfg(params_dtype=torch.int32), 2, "DominoTransformer")
    with pytest.raises(ValueError, match=r"config.recompute_granularity must be None or 'full', got 'selective'"):
        check_config(_cfg(recompute_granularity="selective"), 2, "DominoTransformer")
    with pytest.raises(TypeError, match=r"lacks attribute\(s\) \['num_layers'"):
        check_config(object(), 2, "DominoTransformer")
    check_config(_cfg(), 4, "DominoTransformer")  # a good one passes
    assert _cfg().ffn_hidden_size == 64 and _cfg().kv_channels == 4


def test_mpu_checks():
    with pytest.raises(ValueError, match="mpu is None"):
        tp_group_of(None, "DominoTransformer")
    with pytest.raises(TypeError, match=r"has no method get_tensor_model_parallel_group\(\)"):
        tp_group_of(object(), "DominoTransformer")

    class NoGroup:
        def get_tensor_model_parallel_group(self):
            return None

        def get_tensor_model_parallel_world_size(self):
            return 2

    with pytest.raises(ValueError, match=r"mpu.get_tensor_model_parallel_group\(\) is None"):
        tp_group_of(NoGroup(), "ShardedAttention")


def test_split_micro_batch():
    x = torch.arange(4 * 6 * 2.0).view(4, 6, 2)
    h0, h1 = split_micro_batch(x, "DominoTransformer")
    assert torch.equal(torch.cat([h0, h1], dim=1), x) and h0.shape == (4, 3, 2)
    for bad, what in ((torch.zeros(4, 5, 2), "micro-batch size 5"), (torch.zeros(4, 1, 2), "micro-batch size 1"),
                      (torch.zeros(4, 2), "must be a \\[sequence, batch, hidden\\] tensor")):
        with pytest.raises(ValueError, match=what):
            split_micro_batch(bad, "DominoTransformer")


def test_async_linear_backward_matches_autograd():
    from deepspeed_c.runtime.domino.async_linear import DominoAsyncColumnParallelLinearImpl

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(3, 5, 6, generator=g, dtype=torch.float64).transpose(0, 1)  # a non-contiguous gradient
    table: dict = {}
    out = DominoAsyncColumnParallelLinearImpl.apply(x, w, b, table, "BATCH0", None)
    grads = torch.autograd.grad((out * probe).sum(), (x, w, b))
    ref = torch.autograd.grad((torch.nn.functional.linear(x, w, b) * probe).sum(), (x, w, b))
    for mine, theirs in zip(grads, ref):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    assert table == {}  # no group: nothing to all-reduce, nothing filed
