"""deepspeed.module_inject.layers: tensor-parallel Linear layers for AutoTP training (Megatron's scheme).

LinearLayer (column parallel) keeps rows [r*n/P, (r+1)*n/P) of the weight (and bias): each rank
produces its slice of the output features. Its input is replicated across the TP group, so the
gradient of that input is the sum of every rank's partial gradient: identity forward, all-reduce
backward (ColumnParallel).
LinearAllreduce (row parallel) keeps columns [r*k/P, (r+1)*k/P): each rank computes a partial
product from its slice of the input features; the sum over the group is the full output: all-reduce
forward, identity backward (RowParallel). The bias is replicated and added once, after the sum.
Everything outside these pairs runs replicated and identically on the ranks of a TP group, so
replicated parameters get identical gradients there and need only the data-parallel reduction.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from deepspeed_c import comm as dist
from deepspeed_c.runtime.autograd_paths import transforms_active
from deepspeed_c.runtime.tensor_parallel.mode import (get_auto_tp_mode, is_autotp_training_mode,  # noqa: F401
                                                      set_autotp_mode)


class ColumnParallel(torch.autograd.Function):
    """Identity forward; the input gradient is all-reduced over the tensor-parallel group."""

    @staticmethod
    def forward(ctx: Any, group: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph: the all-reduce must stay differentiable (its adjoint is a copy)
            return None, TPReduce.apply(ctx.group, grad)
        grad = grad.contiguous()  # all_reduce works in place: never on autograd's buffer seen elsewhere
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return None, out


class RowParallel(torch.autograd.Function):
    """All-reduce forward (partial products summed); identity backward."""

    @staticmethod
    def forward(ctx: Any, group: Any, x: Tensor, is_inference_mode: bool = False) -> Tensor:  # type: ignore[override]
        ctx.group = group
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph: the gradient of this copy of a replicated grad is all-reduced
            return None, TPCopy.apply(ctx.group, grad), None
        return None, grad, None


# -- the same collectives at every order of differentiation and under torch.func -----------------------
# Each is the adjoint of its partner (copy <-> all-reduce, gather <-> split), and each backward applies the
# partner, so a create_graph backward gets a differentiable gradient with the cross-rank terms of its second
# derivative. They define setup_context and a vmap rule (the collective of a batched tensor is the collective
# of its physical tensor, the batch dimension kept where it is: equal on every rank, as the model runs
# replicated), which the fast Functions above leave out to keep torch's cheaper apply.


class TPCopy(torch.autograd.Function):
    """Identity forward (a replicated input entering sharded compute); backward all-reduces (TPReduce)."""

    @staticmethod
    def forward(group: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.group = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:  # type: ignore[override]
        return None, TPReduce.apply(ctx.group, grad)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, group: Any, x: Tensor) -> tuple:
        return TPCopy.apply(group, x), in_dims[1]


class TPReduce(torch.autograd.Function):
    """All-reduce (sum) forward of partial results; backward is a copy (TPCopy)."""

    @staticmethod
    def forward(group: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.group = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:  # type: ignore[override]
        return None, TPCopy.apply(ctx.group, grad)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, group: Any, x: Tensor) -> tuple:
        return TPReduce.apply(group, x), in_dims[1]


def _batch_first(x: Tensor, bdim: Optional[int]) -> tuple[Tensor, Optional[int]]:
    # a batch dimension moved to the front leaves the logical last dimension last
    return (x, None) if bdim is None else (x.movedim(bdim, 0), 0)


class TPGatherLast(torch.autograd.Function):
    """All-gather of the ranks' shards along the last dimension; backward keeps this rank's slice (TPSplitLast)."""

    @staticmethod
    def forward(group: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return gather_full(x, x.dim() - 1, group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.group = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:  # type: ignore[override]
        return None, TPSplitLast.apply(ctx.group, grad)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, group: Any, x: Tensor) -> tuple:
        x, bdim = _batch_first(x, in_dims[1])
        return TPGatherLast.apply(group, x), bdim


class TPSplitLast(torch.autograd.Function):
    """This rank's slice along the last dimension of a replicated tensor; backward all-gathers (TPGatherLast)."""

    @staticmethod
    def forward(group: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        world = dist.get_world_size(group)
        if x.shape[-1] % world:
            raise ValueError(f"tensor parallel: the last dimension {x.shape[-1]} of a tensor of shape "
                             f"{tuple(x.shape)} does not split over the group's {world} ranks")
        n = x.shape[-1] // world
        return x.narrow(-1, dist.get_rank(group) * n, n).contiguous()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.group = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:  # type: ignore[override]
        return None, TPGatherLast.apply(ctx.group, grad)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, group: Any, x: Tensor) -> tuple:
        x, bdim = _batch_first(x, in_dims[1])
        return TPSplitLast.apply(group, x), bdim


def _split(tensor: Tensor, dim: int, world: int, rank: int, what: str) -> Tensor:
    size = tensor.shape[dim]
    if size % world != 0:
        raise ValueError(f"AutoTP: {what} has size {size} along dimension {dim} (shape {tuple(tensor.shape)}), not "
                         f"divisible by the tensor-parallel size {world}; pick an autotp_size that divides it")
    n = size // world
    return tensor.narrow(dim, rank * n, n).clone()


class TensorParallel_Layer(nn.Module):
    """Base of the tensor-parallel layers: its group, rank and the dimension its weight is split along."""

    partition_dim: int = 0

    def __init__(self, mp_group: Any, **kwargs: Any) -> None:
        super().__init__()
        self.mp_group = mp_group
        self.tp_world_size = dist.get_world_size(mp_group) if mp_group is not None else 1
        self.tp_index = dist.get_rank(mp_group) if mp_group is not None else 0
        self.world_size, self.rank = self.tp_world_size, self.tp_index  # DeepSpeed's older names
        self.name: Optional[str] = kwargs.get("name")
        self.support_training = True

    def _mark(self, param: Optional[nn.Parameter], sharded: bool) -> None:
        # DeepSpeed's marker: the gradient norm counts a sharded parameter once per TP rank
        if param is not None:
            param.ds_is_tensor_model_parallel = sharded
            param.tensor_model_parallel = sharded
            param.partition_dim = self.partition_dim if sharded else None

    def _shard(self, param: Optional[nn.Parameter], dim: int, what: str) -> Optional[nn.Parameter]:
        if param is None:
            return None
        return nn.Parameter(_split(param.data, dim, self.tp_world_size, self.tp_index, what),
                            requires_grad=param.requires_grad)

    @torch.no_grad()
    def gather_params(self, params_list: list) -> None:
        """Replaces each sharded parameter's data with the full tensor (all-gather over the TP group)."""
        for p in params_list:
            if p is not None and getattr(p, "ds_is_tensor_model_parallel", False):
                p.data = self._gather(p.data, p.partition_dim)

    @torch.no_grad()
    def _tp_partition(self, params_list: list) -> None:
        """Back to this rank's shard (after gather_params)."""
        for p in params_list:
            if p is not None and getattr(p, "ds_is_tensor_model_parallel", False):
                p.data = self._shard(p, p.partition_dim, self.label()).data

    def full_state(self) -> dict[str, Tensor]:
        """{'weight': full weight, 'bias': full bias} gathered over the TP group (every TP rank must call)."""
        out = {}
        for key in ("weight", "bias"):
            p = getattr(self, key)
            if p is None:
                continue
            full = self._gather(p.data, p.partition_dim) if p.ds_is_tensor_model_parallel else p.data
            if key == "weight" and getattr(self, "conv1d", False):
                full = full.t()  # back to transformers' Conv1D layout [in, out]
            out[key] = full.detach().contiguous().clone()
        return out

    def _gather(self, shard: Tensor, dim: int) -> Tensor:
        return gather_full(shard, dim, self.mp_group)

    def label(self) -> str:
        """How messages name the layer: its module path when the injector gave one, else its class."""
        return self.name or type(self).__name__

    # -- whole <-> shard, for checkpoints and loaders (runtime/checkpointing/tensor_parallel.py,
    # inference/checkpoint_loader.py); subclasses override the _gather / _shard hooks
    def gather_whole(self, shard: Tensor, dim: int) -> Tensor:
        """The whole tensor of which each TP rank holds `shard` (cut along `dim`); collective over the TP group."""
        return self._gather(shard, dim)

    def cut_shard(self, whole: Tensor, dim: int, what: str) -> Tensor:
        """This rank's slice of `whole`, cut as the layer cut its own weights; `what` names it in errors."""
        return self._shard(nn.Parameter(whole, requires_grad=False), dim, what).data

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]} (shard {self.tp_index} of " \
               f"{self.tp_world_size}), bias={self.bias is not None}"


def gather_full(shard: Tensor, dim: int, group: Any) -> Tensor:
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class LinearLayer(TensorParallel_Layer):
    """Column-parallel Linear: output features sharded, input replicated."""

    partition_dim = 0

    def __init__(self, module: nn.Module, mp_group: Any = None, skip_partition: bool = False,
                 gather_output: bool = False, **kwargs: Any) -> None:
        super().__init__(mp_group, **kwargs)
        self.gather_output = gather_output
        # a fused projection ([q|k|v], [gate|up]) is split part by part: each rank keeps its rows of every part
        self.fused_sizes: Optional[list[int]] = kwargs.get("fused_sizes")
        if self.fused_sizes is not None and sum(self.fused_sizes) != module.weight.shape[0]:
            raise ValueError(f"AutoTP: {self.label()} has {module.weight.shape[0]} output features but its fused "
                             f"parts {self.fused_sizes} sum to {sum(self.fused_sizes)}")
        self.weight = module.weight if skip_partition else self._shard(module.weight, 0, f"{self.label()}.weight")
        self.bias = module.bias if skip_partition else self._shard(module.bias, 0, f"{self.label()}.bias")
        self._mark(self.weight, True)
        self._mark(self.bias, True)

    def _shard(self, param: Optional[nn.Parameter], dim: int, what: str) -> Optional[nn.Parameter]:
        if param is None or self.fused_sizes is None:
            return super()._shard(param, dim, what)
        parts = param.data.split(self.fused_sizes, dim=0)
        mine = [_split(t, 0, self.tp_world_size, self.tp_index, f"{what} part {i}") for i, t in enumerate(parts)]
        return nn.Parameter(torch.cat(mine, dim=0), requires_grad=param.requires_grad)

    def _gather(self, shard: Tensor, dim: int) -> Tensor:
        if self.fused_sizes is None:
            return super()._gather(shard, dim)
        world = self.tp_world_size
        per_rank = gather_full(shard, 0, self.mp_group).split(shard.shape[0], dim=0)
        local = [n // world for n in self.fused_sizes]
        by_part = [piece.split(local, dim=0) for piece in per_rank]  # [rank][part]
        return torch.cat([torch.cat([by_part[r][i] for r in range(world)], dim=0) for i in range(len(local))], dim=0)

    def forward(self, input: Tensor) -> Tensor:
        # under a torch.func transform the differentiable twins run: the fast Functions have no vmap rule
        plain = transforms_active()
        if self.mp_group is not None and self.tp_world_size > 1:
            input = (TPCopy if plain else ColumnParallel).apply(self.mp_group, input)
        out = torch.nn.functional.linear(input, self.weight, self.bias)
        if self.gather_output and self.tp_world_size > 1:
            out = (TPGatherLast if plain else _GatherLastDim).apply(self.mp_group, out)
        return out


class LinearAllreduce(TensorParallel_Layer):
    """Row-parallel Linear: input features sharded, partial outputs all-reduced, bias added once."""

    partition_dim = 1

    def __init__(self, module: nn.Module, mp_group: Any = None, **kwargs: Any) -> None:
        super().__init__(mp_group, **kwargs)
        self.weight = self._shard(module.weight, 1, f"{self.label()}.weight")
        self.bias = module.bias  # replicated: its gradient is equal on every TP rank
        self._mark(self.weight, True)
        self._mark(self.bias, False)

    def forward(self, input: Tensor) -> Tensor:
        out = torch.matmul(input, self.weight.t())
        if self.mp_group is not None and self.tp_world_size > 1:
            out = TPReduce.apply(self.mp_group, out) if transforms_active() else \
                RowParallel.apply(self.mp_group, out, not self.training)
        return out + self.bias if self.bias is not None else out


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dimension; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx: Any, group: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.group, ctx.n = group, x.shape[-1]
        return gather_full(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph: the slice's adjoint (an all-gather) must stay in the graph
            return None, TPSplitLast.apply(ctx.group, grad)
        rank = dist.get_rank(ctx.group)
        return None, grad.narrow(-1, rank * ctx.n, ctx.n).contiguous()
