"""MiCS: ZeRO-3 sharded inside groups of `mics_shard_size` ranks and replicated across them (DeepSpeed 0.19.6's
runtime/zero/mics.py behaviour; its groups are mics_utils.py's).

What changes against plain ZeRO-3 (stage3.py), and nothing else:
- the parameter store, the gradient reduce-scatter and the optimizer partitions are cut over the shard group
  (rank = place in the shard group, world = mics_shard_size), so gathers stay inside the group;
- at the accumulation boundary, once the last backward's reduce-scatters are in, each rank's gradient
  partitions are divided by the replica count and all-reduced over its replica group (the same place in
  every shard group) in one collective: the partitions then hold the average over the whole data-parallel
  world, as ZeRO-3's would, and the norm, clipping and overflow check over the shard group are the global
  ones (every replica holds the same partitions);
- with `mics_hierarchical_params_gather` a unit's gather is an all-gather across nodes (the ranks at this
  rank's place of each node of the shard group) followed by one inside the node, the values permuted into
  place: the same bytes land as with one flat all-gather, so results are bitwise the same;
- checkpoints: DeepSpeed's MiCS layout, a ZeRO-3 checkpoint of mics_shard_size partitions written by the first
  shard group only (zero_pp_rank_{0..S-1}_* files; the model-states files record the whole data-parallel world
  as dp_world_size and the config's mics_shard_size, from which a load knows the partition count); every
  replica reads its place's files, and the checkpointer reshards to another shard size or world.

DeepSpeed refuses optimizer offload with MiCS ("Local sharding has no support for CPU offloading"); so does the
config here, and ZeRO++ with MiCS is not built (runtime/config/zero.py names the keys)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from deepspeed_c.runtime.zero.mics_utils import MiCS_CommGroups, create_mics_comm_groups
from deepspeed_c.runtime.zero.partition_parameters import Init
from deepspeed_c.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3, Zero3Params, _Stage3Round

__all__ = ["MiCS_Init", "MiCS_Optimizer", "MiCS_CommGroups", "HierarchicalGatherer", "mics_zero3_params"]


def _comm() -> Any:
    import deepspeed_c.comm as dist

    return dist


def _mics_section(cfg: Any) -> tuple[int, bool]:
    """(mics_shard_size, mics_hierarchical_params_gather) of a config dict's zero_optimization."""
    zero = (cfg or {}).get("zero_optimization") if isinstance(cfg, dict) else None
    zero = zero if isinstance(zero, dict) else {}
    size = zero.get("mics_shard_size", -1)
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"MiCS_Init: the config's zero_optimization.mics_shard_size must be a positive int (the "
                         f"ranks each parameter is sharded over), got {size!r}")
    hier = zero.get("mics_hierarchical_params_gather", False)
    if not isinstance(hier, bool):
        raise ValueError(f"MiCS_Init: zero_optimization.mics_hierarchical_params_gather must be a bool, got {hier!r}")
    return size, hier


class MiCS_Init(Init):  # noqa: N801 (DeepSpeed's class name)
    """zero.Init whose parameters are sharded over the shard group of `mics_shard_size` ranks (the config's)
    and replicated across the shard groups. Every rank starts from the values of the data-parallel group's
    first rank (broadcast over the whole group first), so every replica holds the same model."""

    def __init__(self, module: Optional[torch.nn.Module] = None, data_parallel_group: Any = None,
                 sequence_data_parallel_group: Any = None, mem_efficient_linear: bool = True,
                 remote_device: Any = None, pin_memory: bool = False, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, dtype: Optional[torch.dtype] = None,
                 mpu: Any = None) -> None:
        if config_dict_or_path is None and config is None:
            raise ValueError("MiCS_Init needs config_dict_or_path: the config's zero_optimization.mics_shard_size "
                             "says how many ranks shard each parameter")
        if sequence_data_parallel_group is not None:
            if data_parallel_group is not None:
                raise ValueError("MiCS_Init: pass either data_parallel_group or sequence_data_parallel_group, not both")
            data_parallel_group = sequence_data_parallel_group
        from deepspeed_c.runtime.zero.partition_parameters import _config_dict

        import deepspeed_c.comm as dist

        if not dist.is_initialized():
            dist.init_distributed()
        if data_parallel_group is None and mpu is not None:
            data_parallel_group = mpu.get_data_parallel_group()
        size, hier = _mics_section(_config_dict(config_dict_or_path, config))
        self.ds_process_group = data_parallel_group  # the whole data-parallel group (broadcasts)
        self.mics_comm_groups = create_mics_comm_groups(size, data_parallel_group, hier)
        self._pending_module = module
        super().__init__(None, self.mics_comm_groups.param_shard_group, mem_efficient_linear, remote_device,
                         pin_memory, config_dict_or_path, config, enabled, dtype)
        if not enabled:
            return
        if module is not None:
            for m in module.modules():
                self.partition_module(m)

    @torch.no_grad()
    def partition_module(self, module: torch.nn.Module) -> None:
        import torch.distributed as tdist

        from deepspeed_c.runtime.zero.partition_parameters import is_zero_param

        if self.mics_comm_groups.param_repli_size > 1:
            # Init broadcasts inside the shard group only: first make every shard group's source agree
            src = 0 if self.ds_process_group is None else tdist.get_global_rank(self.ds_process_group, 0)
            for p in module._parameters.values():
                if p is None or is_zero_param(p) or p.is_meta:
                    continue
                p.data = p.data.to(device=self.compute_device,
                                   dtype=self.dtype if p.is_floating_point() else p.dtype)
                tdist.broadcast(p.data, src, group=self.ds_process_group)
        super().partition_module(module)
        for p in module._parameters.values():
            if p is not None:
                p.comm = self.mics_comm_groups  # DeepSpeed's attribute: MiCS_Optimizer reads the groups there

    def get_partition_dp_group(self, param: Any) -> Any:
        return self.mics_comm_groups.param_shard_group

    def get_partition_rank(self) -> int:
        return self.mics_comm_groups.param_shard_rank

    @property
    def num_partitions(self) -> int:
        return self.mics_comm_groups.param_shard_size


class _Gathers:
    """The intra-node all-gathers of one hierarchical fetch; wait() puts every unit's values in place."""

    def __init__(self, works: list[Any], moves: list[tuple[torch.Tensor, torch.Tensor, int, int]]) -> None:
        self.works, self.moves = works, moves

    def wait(self) -> None:
        works, self.works = self.works, []
        for w in works:
            if w is not None:
                w.wait()
        moves, self.moves = self.moves, []
        for full, staged, nodes, local in moves:  # staged [local][node][chunk] -> full [node][local][chunk]
            c = full.numel() // (nodes * local)
            full.view(nodes, local, c).copy_(staged.view(local, nodes, c).transpose(0, 1))


class HierarchicalGatherer:
    """ParamStore's unit gatherer under mics_hierarchical_params_gather: per unit, this rank's chunk is
    all-gathered across the nodes of the shard group (N chunks: the same place of every node), then those are
    all-gathered inside the node, and the [local][node] result is permuted into the unit's [node][local]
    order. The cross-node gather is awaited before the node's starts (its output is the node's input)."""

    def __init__(self, groups: MiCS_CommGroups) -> None:
        self.inter, self.intra = groups.param_inter_node_shard_group, groups.param_intra_node_group
        self.nodes, self.local = groups.inter_node_size, groups.intra_node_size
        self.collectives = 0

    def gather(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Any:
        dist = _comm()
        if self.local == 1:  # one rank per node: the cross-node gather is the whole gather
            self.collectives += len(outputs)
            return _Gathers([dist.all_gather_into_tensor(o, i, group=self.inter, async_op=True)
                             for o, i in zip(outputs, inputs)], [])
        across = [torch.empty(i.numel() * self.nodes, dtype=i.dtype, device=o.device) for o, i in zip(outputs, inputs)]
        works = [dist.all_gather_into_tensor(a, i, group=self.inter, async_op=True) for a, i in zip(across, inputs)]
        for w in works:
            if w is not None:
                w.wait()
        staged = [torch.empty_like(o) for o in outputs]
        works = [dist.all_gather_into_tensor(s, a, group=self.intra, async_op=True) for s, a in zip(staged, across)]
        self.collectives += 2 * len(outputs)
        return _Gathers(works, [(o, s, self.nodes, self.local) for o, s in zip(outputs, staged)])


class _MiCSRound(_Stage3Round):
    """Stage 3's backward round, then (on the accumulation boundary, after a round that reduced) the
    all-reduce of the gradient partitions over the replica group."""

    def __init__(self, partitioner: Any, coordinator: Any, zeropp: Any, after_boundary: Callable[[], None],
                 is_boundary: Callable[[], bool]) -> None:
        super().__init__(partitioner, coordinator, zeropp)
        self.after_boundary, self.is_boundary = after_boundary, is_boundary

    def end_backward(self) -> None:
        rounds = self.partitioner.rounds
        super().end_backward()
        if self.partitioner.rounds != rounds and self.is_boundary():
            self.after_boundary()


def _groups_for(module: torch.nn.Module, zero_cfg: Any, dp_group: Any) -> MiCS_CommGroups:
    """The groups of a model built under MiCS_Init (DeepSpeed's `param.comm`) when they match the config, else
    the config's (a model built whole, or under zero.Init, is re-sharded by the store)."""
    size, hier = int(zero_cfg.mics_shard_size), bool(zero_cfg.mics_hierarchical_params_gather)
    for p in module.parameters():
        comm = getattr(p, "comm", None)
        if isinstance(comm, MiCS_CommGroups) and comm.param_shard_size == size and comm.hierarchical == hier:
            return comm
        break
    return create_mics_comm_groups(size, dp_group, hier)


class MiCS_Optimizer(DeepSpeedZeroOptimizer_Stage3):  # noqa: N801 (DeepSpeed's class name)
    """ZeRO-3's optimizer over the shard group, the gradient partitions all-reduced over the replica group on
    the accumulation boundary. Takes stage 3's arguments, `rank` / `world_size` / `dp_process_group` being the
    whole data-parallel group's."""

    def __init__(self, module: torch.nn.Module, init_optimizer: torch.optim.Optimizer, *, store_args: dict,
                 zero_cfg: Any, **kwargs: Any) -> None:
        groups = _groups_for(module, zero_cfg, kwargs.get("dp_process_group"))
        self.mics_comm_groups = groups
        self.replica_group, self.replica_size = groups.param_repli_group, max(1, groups.param_repli_size)
        self.replica_all_reduces = 0  # collectives over the replica group, for tests and benchmarks
        self._average = bool(kwargs.get("gradient_average", True))
        is_boundary = kwargs.get("is_boundary") or (lambda: True)
        kwargs.update(rank=groups.param_shard_rank, world_size=groups.param_shard_size,
                      dp_process_group=groups.param_shard_group)
        super().__init__(module, init_optimizer, store_args=store_args, zero_cfg=zero_cfg, **kwargs)
        if groups.hierarchical:
            self.store.use_gatherer(HierarchicalGatherer(groups))
        self._round = _MiCSRound(self.reducer, self.coordinator, self.zeropp, self._reduce_replicas, is_boundary)

    @torch.no_grad()
    def _reduce_replicas(self) -> None:
        """Each gradient partition averaged over the replica group, all in one all-reduce (divided first, as
        DeepSpeed does, so 16-bit sums stay in range)."""
        if self.replica_size <= 1:
            return
        parts = [p for p in self.reducer.grad_partitions if p is not None]
        if not parts:
            return
        by_dtype: dict[Any, list[torch.Tensor]] = {}
        for p in parts:
            by_dtype.setdefault((p.dtype, p.device), []).append(p)
        for same in by_dtype.values():
            flat = same[0] if len(same) == 1 else torch.cat([p.view(-1) for p in same])
            if self._average:
                flat.div_(self.replica_size)
            _comm().all_reduce(flat, group=self.replica_group)
            self.replica_all_reduces += 1
            if len(same) > 1:
                at = 0
                for p in same:
                    p.view(-1).copy_(flat[at:at + p.numel()])
                    at += p.numel()

    def writes_partition_files(self) -> bool:
        """DeepSpeed's MiCS checkpoints are written by the first shard group (the replicas hold the same)."""
        return self.mics_comm_groups.param_repli_rank == 0

    def __repr__(self) -> str:
        return (f"MiCS_Optimizer(shard_size={self.world_size}, replicas={self.replica_size}, "
                f"hierarchical={self.mics_comm_groups.hierarchical}, {self.optimizer!r})")


def mics_zero3_params(module: torch.nn.Module, *, zero_cfg: Any, group: Any, store_args: dict) -> Zero3Params:
    """Stage 3 without an optimizer under MiCS: the store over the shard group."""
    groups = _groups_for(module, zero_cfg, group)
    params = Zero3Params(module, rank=groups.param_shard_rank, world_size=groups.param_shard_size,
                         group=groups.param_shard_group, store_args=store_args, zero_cfg=zero_cfg)
    if groups.hierarchical:
        params.store.use_gatherer(HierarchicalGatherer(groups))
    return params
