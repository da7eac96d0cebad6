"""AutoSP's graph operations (DeepSpeed's deepspeed.compile.custom_ops.all_to_all / sp_dp_registry), registered
with torch.library so dynamo, AOT autograd and inductor see them as opaque operators with their own gradients.

`dsc_autosp::all_to_all(x, scatter_dim, gather_dim)` is Ulysses' exchange over the sequence-parallel group on an
SDPA tensor [batch, heads, seq, head_dim]: (1, 2) turns this rank's sequence chunk of every head into the whole
sequence of its heads' share, (2, 1) turns it back; each one's gradient is the other.
`dsc_autosp::aggregate_loss(loss, count)` turns this rank's token-mean loss into the mean over the whole
sequence (every rank of the group gets it); its gradient to the local loss is count / total, so the gradients
the ranks' backwards leave on a replicated weight add up (over the group) to the whole-sequence gradient.

The group lives here (an operator schema carries no Python object): the engine's compile registers it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from deepspeed_c import comm as dist


@dataclass
class SequenceGroup:
    group: Any
    size: int
    rank: int


_GROUP: Optional[SequenceGroup] = None


def register_group(group: Any, size: int, rank: int) -> SequenceGroup:
    global _GROUP
    _GROUP = SequenceGroup(group, int(size), int(rank))
    return _GROUP


def current_group() -> Optional[SequenceGroup]:
    return _GROUP


def _group() -> SequenceGroup:
    if _GROUP is None:
        raise RuntimeError("AutoSP: no sequence-parallel group is registered; engine.compile() with "
                           "config 'compile.passes' ['autosp'] registers it")
    return _GROUP


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    from deepspeed_c.sequence.layer import _all_to_all  # Ulysses' exchange math (one all_to_all_single)

    g = _group()
    if g.size == 1:
        return x.clone()  # a custom op's output may not alias its input
    return _all_to_all(x.contiguous(), scatter_dim, gather_dim, g.group)


@torch.library.custom_op("dsc_autosp::all_to_all", mutates_args=())
def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    return _exchange(x, scatter_dim, gather_dim)


@all_to_all.register_fake
def _all_to_all_fake(x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    size = _group().size
    shape = list(x.shape)
    shape[scatter_dim] = shape[scatter_dim] // size
    shape[gather_dim] = shape[gather_dim] * size
    return x.new_empty(shape)


def _a2a_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    _, ctx.scatter_dim, ctx.gather_dim = inputs


def _a2a_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    return all_to_all(grad, ctx.gather_dim, ctx.scatter_dim), None, None


all_to_all.register_autograd(_a2a_backward, setup_context=_a2a_setup)


@torch.library.custom_op("dsc_autosp::aggregate_loss", mutates_args=())
def aggregate_loss(loss: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole sequence's mean loss, the whole sequence's counted tokens)."""
    g = _group()
    n = count.to(loss.dtype)
    # a rank whose tokens are all ignored has a 0/0 = nan local mean: it contributes nothing
    both = torch.stack([torch.where(n > 0, loss * n, torch.zeros_like(loss)), n])
    if g.size > 1:
        dist.all_reduce(both, group=g.group)
    return both[0] / both[1], both[1].clone()


@aggregate_loss.register_fake
def _aggregate_loss_fake(loss: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(loss), torch.empty_like(loss)


def _agg_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(inputs[1], output[1])


def _agg_backward(ctx: Any, grad: torch.Tensor, _grad_total: Any) -> tuple:
    count, total = ctx.saved_tensors
    n = count.to(grad.dtype)
    return torch.where(n > 0, grad * n / total, torch.zeros_like(grad)), None


aggregate_loss.register_autograd(_agg_backward, setup_context=_agg_setup)
