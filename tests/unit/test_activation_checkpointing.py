"""deepspeed_c.checkpointing: gradients through checkpoint()/non_reentrant_checkpoint() equal those of
the plain module with dropout active (RNG replayed, model-parallel tracker included), configure()'s
rules, and the RNG tracker."""
from __future__ import annotations

import pytest
import torch

import deepspeed_c
from deepspeed_c import checkpointing as ckpt


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 8)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.a(x)))
        with ckpt.get_cuda_rng_tracker().fork():
            h = torch.nn.functional.dropout(h, 0.3, training=True)
        return self.b(h)


def run(wrapper, seed: int = 5):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([Block(), Block()])
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ckpt.model_parallel_cuda_manual_seed(seed)
    h = x
    for blk in blocks:
        h = wrapper(blk, h)
    loss = (h ** 2).sum()
    loss.backward()
    grads = [p.grad.clone() for p in blocks.parameters()]
    after = (torch.rand(3), ckpt.get_cuda_rng_tracker().get_states())
    return loss.detach(), x.grad.clone(), grads, after


@pytest.mark.parametrize("fn", ["checkpoint", "non_reentrant_checkpoint"])
def test_gradients_match_plain_run_with_dropout(fn):
    plain = run(lambda blk, h: blk(h))
    wrapped = run(lambda blk, h: getattr(ckpt, fn)(blk, h))
    assert torch.equal(plain[0], wrapped[0])
    assert torch.equal(plain[1], wrapped[1])
    for a, b in zip(plain[2], wrapped[2]):
        assert torch.equal(a, b)
    # the RNG streams continue where a plain run leaves them
    assert torch.equal(plain[3][0], wrapped[3][0])
    for name, state in plain[3][1].items():
        assert torch.equal(state, wrapped[3][1][name])
    # and dropout really was active: a different seed changes the loss
    assert not torch.equal(plain[0], run(lambda blk, h: blk(h), seed=6)[0])


def test_checkpoint_matches_with_frozen_input_and_non_tensor_args():
    lin = torch.nn.Linear(5, 5)
    x = torch.randn(2, 5)

    def f(t, scale):
        return torch.nn.functional.dropout(lin(t), 0.5) * scale

    torch.manual_seed(3)
    ref = f(x, 2.0).sum()
    ref.backward()
    want = lin.weight.grad.clone()
    lin.weight.grad = None
    torch.manual_seed(3)
    ckpt.non_reentrant_checkpoint(f, x, 2.0).sum().backward()
    assert torch.equal(lin.weight.grad, want)


def test_configure_rules_and_state():
    ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"partition_activations": True,
                                                                        "number_checkpoints": 4}})
    assert ckpt.is_configured() and ckpt.PARTITION_ACTIVATIONS and ckpt.num_layers == 4
    ckpt.configure(None, partition_activations=False)
    assert not ckpt.PARTITION_ACTIVATIONS
    with pytest.raises(ValueError, match="partition_activations"):
        ckpt.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    with pytest.raises(ValueError, match="partition_activations"):
        ckpt.configure(None, checkpoint_in_cpu=True)
    ckpt.configure(None, partition_activations=True, checkpoint_in_cpu=True)
    try:
        assert test_gradients_match_plain_run_with_dropout("checkpoint") is None
    finally:
        ckpt.configure(None, partition_activations=False, checkpoint_in_cpu=False)
    ckpt.reset()
    assert deepspeed_c.checkpointing is ckpt


def test_tracker_rules():
    tracker = ckpt.CudaRNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(Exception, match="already exists"):
        tracker.add("b", 1)
    with pytest.raises(Exception, match="not added"):
        with tracker.fork("zzz"):
            pass
    outside = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(2)
    assert torch.equal(torch.get_rng_state(), outside)
    with tracker.fork("a"):
        second = torch.rand(2)
    assert not torch.equal(first, second)
    torch.manual_seed(1)
    assert torch.equal(first, torch.rand(2))


class _OneRankMPU:
    """A model-parallel unit of one rank: nothing to partition over."""

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_group(self) -> None:
        return None


@pytest.mark.parametrize("mpu", [None, _OneRankMPU()], ids=["no-mpu", "mp-1"])
def test_partition_activations_without_model_parallel_group_warns_why(mpu):
    """Issue 46's bad input: partition_activations from the JSON with no model-parallel group of more than one
    rank is a warning naming the key and why (nothing to split over), and checkpointing still gives the plain
    module's gradients."""
    import io
    import logging

    from deepspeed_c.utils.logging import logger

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)  # the package's logger does not propagate to pytest's
    try:
        ckpt.configure(mpu, deepspeed_config={"activation_checkpointing": {"partition_activations": True,
                                                                           "cpu_checkpointing": True}})
    finally:
        logger.removeHandler(handler)
    try:
        msgs = [m for m in stream.getvalue().splitlines() if "activation_checkpointing.partition_activations" in m]
        assert len(msgs) == 1 and "no model-parallel group of more than one rank" in msgs[0], stream.getvalue()
        assert ckpt.PARTITION_ACTIVATIONS and ckpt.CPU_CHECKPOINT
        assert test_gradients_match_plain_run_with_dropout("checkpoint") is None
    finally:
        ckpt.configure(None, partition_activations=False, checkpoint_in_cpu=False)
        ckpt.reset()
